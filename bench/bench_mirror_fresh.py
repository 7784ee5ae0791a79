"""A mirror's freshness as a user sees it (docs/cdc.md, "Mirror tables"): the
time from a request's 2xx to the moment the mirror's committed state covers
its events, through the whole daemon (``eventplane run``, one
``[[cdc.mirrors]]`` on local disk, no CDC stream so no JVM).

Per ``--keys``: one daemon, preloaded over HTTP with that many keys (inserts
until the mirror's commits cover the last acknowledged LSN), then an open loop
at ``--rate`` events/s (requests of ``--per-request`` events: 90 % updates,
5 % inserts of new keys, 5 % deletes) for ``--duration`` seconds with uniform
keys, then again on the same daemon with hot keys (80 % of the changes to 5 %
of the keys). ``daemon.cores = 1``: a batch is one slice, a prefix of the WAL,
so a commit covers every LSN up to the end of its range.

Visibility is read from outside, as a reader would: a thread polls the mirror
with delta-rs (``update_incremental``, then the new commits' ``userMetadata``,
whose ``eventplane.ranges`` name the batch's LSNs) every ``--poll-ms``; the
poll period achieved is printed. Per row: freshness p50/p99/max, the achieved
rate, the ack p99 (from schedule), merges per second and the daemon's CPU
seconds over the load and its drain.

    python -m bench.bench_mirror_fresh --keys 100000 1000000 --duration 20

``--merge-interval-ms 0 1000 10000`` runs each keys row once per value of the
mirror's ``merge_interval_ms`` (a daemon each; docs/cdc.md, "Coalesced
merges"), and ``--mixes uniform`` leaves out the hot keys. The merge cost per
change is the daemon's CPU over the load and its drain per event (ingest and
the WAL included: they are the same for every value, the merges are not).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from bench.bench_ingest import _free_port
from bench.common import process_tree, start_daemon, total_cpu_seconds

HEADERS = {"Content-Type": "application/x-ndjson"}


class Target(Protocol):
    """Where the producers post: the daemon, or another bench's peer server."""

    url: str


class Daemon:
    """``eventplane run`` with one mirror of ``orders`` on local disk."""

    def __init__(self, root: Path, interval_ms: int, merge_interval_ms: int = 0) -> None:
        self.dir = root / f"daemon-{time.monotonic_ns()}"
        self.dir.mkdir()
        self.mirror = self.dir / "mirror"
        ingest, self.admin = _free_port(), _free_port()
        text = (
            f'[daemon]\ndata_dir = "data"\ncores = 1\n'
            f'[ingest]\nlisten = "127.0.0.1:{ingest}"\n'
            f'[admin]\nlisten = "127.0.0.1:{self.admin}"\n'
            f"[microbatch]\ninterval_ms = {interval_ms}\n"
            '[log]\nlevel = "warning"\nformat = "json"\n'
            "[[cdc.mirrors]]\n"
            f'name = "orders"\ncollection = "orders"\npath = "{self.mirror}"\n'
            'columns = { amount = "double", status = "string" }\nbuckets = 16\n'
            f"merge_interval_ms = {merge_interval_ms}\n"
        )
        (self.dir / "config.toml").write_text(text)
        self.proc = start_daemon(self.dir, self.admin, "the daemon")
        self.url = f"http://127.0.0.1:{ingest}/v1/events"

    def cpu_seconds(self) -> float:
        return total_cpu_seconds(process_tree(self.proc.pid))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Watcher(threading.Thread):
    """Polls the mirror's Delta log: ``commits`` is (monotonic time seen, last
    LSN covered) per MERGE, in order; ``merges`` counts them."""

    def __init__(self, path: Path, poll_s: float) -> None:
        super().__init__(name="mirror-watcher", daemon=True)
        self.path, self.poll_s = path, poll_s
        self.commits: list[tuple[float, int]] = []
        self.covered = 0
        self.polls = 0
        self.poll_started = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        from deltalake import DeltaTable

        table = None
        seen = -1
        while not self._halt.is_set():
            self.polls += 1
            try:
                if table is None:
                    table = DeltaTable(str(self.path))
                else:
                    table.update_incremental()
            except Exception:  # not created yet
                self._halt.wait(self.poll_s)
                continue
            now = time.monotonic()
            version = int(table.version())
            if version > seen:
                fresh = table.history(version - seen) if seen >= 0 else table.history(1)
                for entry in reversed(fresh):
                    meta = entry.get("userMetadata")
                    if entry.get("operation") != "MERGE" or not meta:
                        continue
                    last = self.last_of(meta)
                    if last > self.covered:
                        self.covered = last
                        self.commits.append((now, last))
                seen = version
            self._halt.wait(self.poll_s)

    def last_of(self, meta: str) -> int:
        """The last LSN a MERGE commit's ``userMetadata`` says it covers."""
        ranges = json.loads(meta)["eventplane"]["ranges"]
        return int(max(b for _, b in ranges.values()))

    def reset_polls(self) -> None:
        self.polls, self.poll_started = 0, time.monotonic()

    def poll_period_ms(self) -> float:
        return (time.monotonic() - self.poll_started) * 1e3 / max(self.polls, 1)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def _body(events: list[dict[str, Any]]) -> bytes:
    return ("\n".join(json.dumps(e, separators=(",", ":")) for e in events) + "\n").encode()


def preload_bodies(keys: int, per_request: int = 2000) -> list[bytes]:
    def insert(i: int) -> dict[str, Any]:
        new = {"amount": float(i), "status": "insert"}
        return {"collection": "orders", "op": "insert", "key": f"k{i}", "new": new}

    return [
        _body([insert(i) for i in range(start, min(start + per_request, keys))])
        for start in range(0, keys, per_request)
    ]


def change_bodies(
    keys: int,
    hot: bool,
    requests: int,
    per_request: int,
    seed: int,
    next_key: int,
    shards: int = 1,
    first_n: int = 0,
) -> tuple[list[bytes], int]:
    """90 % updates, 5 % inserts of keys from ``next_key`` on, 5 % deletes;
    the bodies and the next key never used. ``new.n`` numbers the events from
    ``first_n``.

    ``shards`` > 1: request j changes only keys ``k{i}`` with i % shards ==
    j % shards (the inserts' new keys excepted, each used once), so that when
    one client posts requests j, j + shards, ... in turn, per key every side
    gets the changes in the same order whatever the clients' interleaving.
    ``shards = 1`` gives the same bodies as before it existed."""
    rng = random.Random(seed)
    hot_keys = max(1, keys // 20)
    bodies = []
    n = first_n
    for j in range(requests):
        shard = j % shards
        events = []
        for _ in range(per_request):
            r = rng.random()
            if r < 0.05:
                key, op = f"k{next_key}", "insert"
                next_key += 1
            else:
                span = hot_keys if hot and rng.random() < 0.8 else keys
                k = shard + shards * rng.randrange(max(1, span // shards))
                key, op = f"k{k}", "delete" if r < 0.10 else "update"
            e: dict[str, Any] = {"collection": "orders", "op": op, "key": key}
            if op != "delete":
                e["new"] = {"amount": round(rng.random() * 1000, 2), "status": op, "n": n}
            events.append(e)
            n += 1
        bodies.append(_body(events))
    return bodies, next_key


async def _post(session: Any, url: str, body: bytes) -> tuple[int, int]:
    while True:
        async with session.post(url, data=body, headers=HEADERS) as resp:
            payload = await resp.read()
            if resp.status == 429:
                await asyncio.sleep(float(resp.headers.get("Retry-After", "0.1")))
                continue
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {payload[:300]!r}")
            doc = json.loads(payload)
            return int(doc["accepted"]), int(doc["last_lsn"])


async def preload(d: Target, bodies: list[bytes], clients: int = 4) -> int:
    """Posts every body; the highest LSN acknowledged."""
    import aiohttp

    todo = iter(bodies)
    last = {"lsn": 0}

    async def producer() -> None:
        async with aiohttp.ClientSession() as session:
            for body in todo:
                _, lsn = await _post(session, d.url, body)
                last["lsn"] = max(last["lsn"], lsn)

    await asyncio.gather(*(producer() for _ in range(clients)))
    return last["lsn"]


async def open_loop(
    d: Target, bodies: list[bytes], rate: float, duration_s: float, clients: int
) -> tuple[list[tuple[float, int]], list[float], float, int]:
    """Each request on schedule: ([(monotonic 2xx time, last LSN)], ack latencies
    from schedule, elapsed s, events acknowledged)."""
    import aiohttp

    per_request = bodies[0].count(b"\n")
    interval = clients * per_request / rate
    acks: list[tuple[float, int]] = []
    latencies: list[float] = []
    done = {"events": 0}
    start = time.monotonic() + 0.2

    async def producer(i: int) -> None:
        async with aiohttp.ClientSession() as session:
            k = 0
            while True:
                due = start + (i / clients) * interval + k * interval
                if due - start >= duration_s:
                    return
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                n, lsn = await _post(session, d.url, bodies[(k * clients + i) % len(bodies)])
                now = time.monotonic()
                acks.append((now, lsn))
                latencies.append(now - due)
                done["events"] += n
                k += 1

    await asyncio.gather(*(producer(i) for i in range(clients)))
    return acks, latencies, time.monotonic() - start, done["events"]


def wait_covered(w: Watcher, lsn: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while w.covered < lsn:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the mirror covers LSN {w.covered}, not {lsn}, after {timeout_s} s")
        time.sleep(0.05)


def freshness(acks: list[tuple[float, int]], commits: list[tuple[float, int]]) -> list[float]:
    """Sorted seconds from each request's 2xx (time, last LSN) to the first
    commit seen (time, last LSN covered, increasing) that covers it; a commit
    seen before the 2xx came back counts 0."""
    out = []
    at = 0
    for acked, lsn in sorted(acks, key=lambda a: a[1]):
        while commits[at][1] < lsn:
            at += 1
        out.append(max(commits[at][0] - acked, 0.0))
    return sorted(out)


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(len(values) * q))]


def measure(
    d: Daemon, w: Watcher, keys: int, hot: bool, args: argparse.Namespace, next_key: int
) -> dict[str, Any]:
    requests = int(args.rate * args.duration / args.per_request) + 1
    bodies, next_key = change_bodies(keys, hot, requests, args.per_request, 44 + hot, next_key)
    merges0 = len(w.commits)
    w.reset_polls()
    cpu0, t0 = d.cpu_seconds(), time.monotonic()
    acks, latencies, elapsed, events = asyncio.run(
        open_loop(d, bodies, args.rate, args.duration, args.clients)
    )
    wait_covered(w, max(lsn for _, lsn in acks), timeout_s=300)
    cpu1, t1 = d.cpu_seconds(), time.monotonic()
    poll_ms = w.poll_period_ms()
    commits = w.commits[merges0:]
    fresh = freshness(acks, commits)
    latencies.sort()
    return {
        "keys": keys,
        "hot": hot,
        "rate": events / elapsed,
        "ack_p99_ms": _q(latencies, 0.99) * 1e3,
        "p50_s": _q(fresh, 0.5),
        "p99_s": _q(fresh, 0.99),
        "max_s": fresh[-1],
        "merges_per_s": len(commits) / (t1 - t0),
        "events_per_merge": events / max(len(commits), 1),
        "cpu_us_per_event": (cpu1 - cpu0) * 1e6 / max(events, 1),
        "cpu_s": cpu1 - cpu0,
        "wall_s": t1 - t0,
        "poll_ms": poll_ms,
        "load_1m": os.getloadavg()[0],
        "next_key": next_key,
    }


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--rate", type=float, default=20_000)
    ap.add_argument("--per-request", type=int, default=200)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--interval-ms", type=int, default=1000, help="microbatch.interval_ms")
    ap.add_argument("--poll-ms", type=float, default=10.0)
    ap.add_argument("--merge-interval-ms", type=int, nargs="+", default=[0])
    ap.add_argument("--mixes", nargs="+", choices=("uniform", "hot"), default=["uniform", "hot"])
    args = ap.parse_args(argv)
    print(f"command: python -m bench.bench_mirror_fresh {' '.join(argv or sys.argv[1:])}")
    print(f"machine: {os.cpu_count()} CPUs, load average {_load()} at the start", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-mirror-fresh-"))
    rows = []
    try:
        for keys in args.keys:
            for merge_ms in args.merge_interval_ms:
                d = Daemon(root, args.interval_ms, merge_ms)
                w = Watcher(d.mirror, args.poll_ms / 1e3)
                w.start()
                try:
                    t0 = time.monotonic()
                    last = asyncio.run(preload(d, preload_bodies(keys)))
                    wait_covered(w, last, timeout_s=600)
                    print(f"preloaded {keys:,} keys in {time.monotonic() - t0:.1f} s", flush=True)
                    next_key = keys
                    for hot in [m == "hot" for m in args.mixes]:
                        r = measure(d, w, keys, hot, args, next_key)
                        r["merge_interval_ms"] = merge_ms
                        next_key = r["next_key"]
                        rows.append(r)
                        print(json.dumps({k: round(v, 3) for k, v in r.items()}), flush=True)
                finally:
                    w.stop()
                    d.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nload average {_load()} at the end (load: the 1-minute one after each row)")
    print(
        "\n| keys | changes to | merge_interval_ms | events/s | ack p99 ms | freshness p50 s "
        "| p99 s | max s | merges/s | events/merge | daemon CPU s | CPU µs/change | over s "
        "| poll ms | load |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        where = "80 % to 5 % of keys" if r["hot"] else "uniform keys"
        print(
            f"| {r['keys']:,} | {where} | {r['merge_interval_ms']} | {r['rate']:,.0f} "
            f"| {r['ack_p99_ms']:.1f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['max_s']:.2f} "
            f"| {r['merges_per_s']:.2f} | {r['events_per_merge']:,.0f} | {r['cpu_s']:.1f} "
            f"| {r['cpu_us_per_event']:.0f} | {r['wall_s']:.1f} "
            f"| {r['poll_ms']:.1f} | {r['load_1m']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
