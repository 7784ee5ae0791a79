"""How long ``eventplane restore`` takes (docs/operating.md, "Losing the machine"):
a daemon with ``[wal.archive] ack = "local"`` takes ``--events`` events
(bench/bench_ingest.py's ~150-byte events, 1000 per request, 16 producers),
archives them into a SeaweedFS server on loopback and stops; its data_dir is
deleted; then, on the same objects in the same run:

A paused mirror stage keeps the whole WAL (and so the whole archive).

- **restore**: ``eventplane restore --config F`` (download, every CRC, LSNs
  contiguous, segments rebuilt and fsynced, the archive taken over, the WAL
  opened again);
- **bare download**: the peer's floor, what copying the archive by hand costs
  (``aws s3 cp --recursive``): every object fetched by 8 threads and written
  to disk with an fsync each, nothing checked or rebuilt.

Per size: wall seconds and CPU seconds of each side, events/s and MB/s of the
restore, and restore/download. The store shares the 2 cores (S3 would not).

Run: ``python -m bench.bench_restore --events 1000000 10000000``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.bench_archive import Daemon
from bench.bench_ingest import make_bodies
from bench.common import cpu_seconds

PRODUCERS = 16
PER_REQUEST = 1000


async def post(url: str, events: int) -> int:
    """Post at least ``events`` events; the count of acknowledged ones."""
    import aiohttp

    bodies = make_bodies(64, PER_REQUEST)
    sent = {"n": 0}

    async def producer(i: int) -> None:
        async with aiohttp.ClientSession() as session:
            k = i
            while sent["n"] < events:
                sent["n"] += PER_REQUEST
                body = bodies[k % len(bodies)]
                k += PRODUCERS
                headers = {"Content-Type": "application/x-ndjson"}
                async with session.post(url, data=body, headers=headers) as r:
                    if r.status != 200:
                        raise RuntimeError(f"ingest answered {r.status}: {await r.text()}")

    await asyncio.gather(*(producer(i) for i in range(PRODUCERS)))
    return sent["n"]


def archived_lsn(admin: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("eventplane_wal_archived_lsn "):
                return int(float(line.split()[-1]))
    return 0


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def download(server: Any, prefix: str, into: Path) -> int:
    """Every object under ``prefix/wal/`` to ``into``, 8 at a time; bytes fetched."""
    s3 = server.client()
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=server.bucket, Prefix=f"{prefix}/wal/"
    ):
        keys += [o["Key"] for o in page.get("Contents", [])]
    into.mkdir(parents=True)

    def fetch(key: str) -> int:
        body = s3.get_object(Bucket=server.bucket, Key=key)["Body"].read()
        path = into / key.rsplit("/", 1)[1]
        with open(path, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        return len(body)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return sum(pool.map(fetch, keys))


# A paused stage keeps every event in the WAL and so in the archive (invariant
# 9): a mirror, which needs no JVM, paused before the first event.
HOLD = '[[cdc.mirrors]]\nname = "hold"\ncollection = "orders"\npath = "mirror"\n'


def pause_hold(admin: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        request = urllib.request.Request(
            f"http://127.0.0.1:{admin}/v1/stages/mirror:hold/pause",
            data=b'{"reason": "bench_restore keeps the archive whole"}',
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def run(root: Path, weed: Any, events: int) -> dict[str, float]:
    d = Daemon(root, "local", weed.server.endpoint, weed.server, flush_ms=100, extra=HOLD)
    try:
        pause_hold(d.admin)
        acked = asyncio.run(post(d.url, events))
        deadline = time.monotonic() + 600
        while archived_lsn(d.admin) < acked:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the archive did not reach LSN {acked} within 600 s")
            time.sleep(0.2)
    finally:
        d.stop()
    shutil.rmtree(d.dir / "data")

    # The restore: its own process (no JVM), its CPU from the children's rusage.
    cpu0, t0 = children_cpu(), time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "daemon.cli.main", "restore", "--config", "config.toml"],
        cwd=d.dir,
        capture_output=True,
        text=True,
        check=False,
    )
    restore_s, restore_cpu = time.monotonic() - t0, children_cpu() - cpu0
    if done.returncode != 0:
        raise RuntimeError(f"restore failed ({done.returncode}): {done.stderr[-2000:]}")
    m = re.search(r"LSN (\d+)\.\.(\d+), (\d+) objects \((\d+) fences\), (\d+) bytes", done.stdout)
    if m is None:
        raise RuntimeError(f"no summary in the restore's output: {done.stdout}")
    first, last, objects, _fences, size = (int(g) for g in m.groups())
    if (first, last) != (1, acked):
        raise RuntimeError(f"restored LSN {first}..{last}, acknowledged 1..{acked}")

    # The peer's floor: the same objects copied by hand.
    me = os.getpid()
    cpu0, t0 = cpu_seconds(me), time.monotonic()
    fetched = download(weed.server, d.dir.name, d.dir / "copy")
    copy_s, copy_cpu = time.monotonic() - t0, cpu_seconds(me) - cpu0
    return {
        "events": acked,
        "objects": objects,
        "mb": size / 1e6,
        "restore_s": restore_s,
        "restore_cpu": restore_cpu,
        "copy_s": copy_s,
        "copy_cpu": copy_cpu,
        "copy_mb": fetched / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, nargs="+", default=[1_000_000])
    args = parser.parse_args(argv)
    from tests.s3.server import start_weed

    root = Path(tempfile.mkdtemp(prefix="bench-restore-"))
    (root / "weed").mkdir()
    weed = start_weed(root / "weed")
    print(
        "| events | objects | MB | restore s (CPU s) | restore events/s | restore MB/s "
        "| bare download s (CPU s) | restore / download |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for events in args.events:
            r = run(root, weed, events)
            print(
                f"| {r['events']:,} | {r['objects']:,} | {r['mb']:,.0f} "
                f"| {r['restore_s']:.1f} ({r['restore_cpu']:.1f}) "
                f"| {r['events'] / r['restore_s']:,.0f} | {r['mb'] / r['restore_s']:.0f} "
                f"| {r['copy_s']:.1f} ({r['copy_cpu']:.1f}) "
                f"| {r['restore_s'] / r['copy_s']:.2f}x |",
                flush=True,
            )
    finally:
        weed.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
