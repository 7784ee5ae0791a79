"""A poisoned trigger against a clean one: does the CDC table keep its freshness?

Two daemons, one after the other in the same run, on the same machine and the
same open-loop load (``--rate`` events/s for ``--seconds``, 200-event
requests over HTTP), each with the shipped interval, one CDC stream and the
README's trigger (``new:amount::double > 1000``, webhook to a loopback
receiver):

- **clean**: every ``amount`` is a number;
- **poisoned**: one event in ``--poison-every`` has ``"amount": "lots"``, a
  row the trigger's cast rejects at run time. The row goes to the trigger's
  DLQ (docs/triggers.md, "Poison rows"); everything else goes on.

Reported per side: the CDC stream's ingest-to-visible latency (p50, p99, max:
from the request's scheduled time to the stream's ledger covering it), the
rows the trigger dead-lettered, and CPU seconds (daemon + its JVM). The aim of
issue 13: the poisoned p99 within 1.2x of the clean one.

    python -m bench.bench_faults [--rate 5000] [--seconds 30] [--poison-every 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from aiohttp import web

from bench.bench_cdc import (
    LATENCY_REQUEST_EVENTS,
    Daemon,
    _percentile,
    e2e_latency,
    start_daemon,
    stop_daemon,
)
from bench.common import HookServer, process_tree, total_cpu_seconds


class Sink(HookServer):
    """Accepts every webhook call and counts the rows."""

    rows = 0

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.rows += len(body["rows"])
        return web.Response(status=200)


def _trigger(url: str) -> str:
    return f"""
[[triggers]]
name = "large-orders"
collection = "orders"
on = ["insert", "update"]
when = "new:amount::double > 1000"
action = {{ type = "webhook", url = "{url}" }}
"""


def _dlq_entries(d: Daemon) -> int:
    with urllib.request.urlopen(f"{d.admin}/v1/status", timeout=5) as r:
        return int(json.load(r)["dlq"]["entries"])


def run_side(root: Path, args: argparse.Namespace, poison_every: int, sink: Sink) -> dict[str, Any]:
    d = start_daemon(root, args.master, args.interval_ms, 100_000, _trigger(sink.url))
    try:
        # Warm-up: the first jobs compile code and start executors.
        asyncio.run(e2e_latency(d, 1, args.rate, 3.0, 0))
        pids = process_tree(d.proc.pid)
        cpu = total_cpu_seconds(pids)
        first = 1 + int(args.rate * 3.0) + LATENCY_REQUEST_EVENTS
        latency = asyncio.run(e2e_latency(d, first, args.rate, args.seconds, poison_every))
        cpu = total_cpu_seconds(pids) - cpu
        dead = _dlq_entries(d)
    finally:
        stop_daemon(d)
    return {
        "p50": _percentile(latency, 0.5),
        "p99": _percentile(latency, 0.99),
        "max": max(latency),
        "requests": len(latency),
        "dlq": dead,
        "cpu_s": cpu,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=int, default=5000, help="events/s (default 5000)")
    p.add_argument("--seconds", type=float, default=30.0, help="load per side (default 30)")
    p.add_argument("--poison-every", type=int, default=20_000, help="default: 1 in 20000")
    p.add_argument("--interval-ms", type=int, default=1000)
    p.add_argument("--master", default="local[*]")
    p.add_argument("--dir", type=Path, help="work folder (default: a temp folder, removed)")
    args = p.parse_args(argv)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-faults-", dir=args.dir))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sink = Sink()
    sink.start()
    try:
        print("clean side ...", file=sys.stderr)
        clean = run_side(root / "clean", args, 0, sink)
        print("poisoned side ...", file=sys.stderr)
        poisoned = run_side(root / "poisoned", args, args.poison_every, sink)
    finally:
        sink.stop()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    events = int(args.rate * args.seconds)
    print(
        f"\nCDC ingest-to-visible at {args.rate:,} events/s for {args.seconds:g} s "
        f"({events:,} events, microbatch.interval_ms = {args.interval_ms}); "
        f"poisoned side: 1 event in {args.poison_every:,} has a non-numeric amount\n"
    )
    print("| side | p50 ms | p99 ms | max ms | trigger DLQ rows | CPU s (daemon + JVM) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in (("clean", clean), ("poisoned", poisoned)):
        print(
            f"| {name} | {r['p50'] * 1000:.0f} | {r['p99'] * 1000:.0f} | {r['max'] * 1000:.0f} "
            f"| {r['dlq']:,} | {r['cpu_s']:.1f} |"
        )
    print(f"\npoisoned / clean p99: {poisoned['p99'] / clean['p99']:.2f}x (aim: at most 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
