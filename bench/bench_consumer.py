"""Consumer catch-up benchmark: WAL -> consumers -> planner -> executor, events/s per core.

A WAL is filled with ~150-byte JSON events, closed and reopened (a restart),
and an :class:`~daemon.plane.eventplane.EventPlane` boots over it: every core starts in
CatchUp from watermark 0, replays its events from the WAL in a worker thread,
fills micro-batch slices, and a counting executor (the recording executor
without the recording: it keeps no rows) commits them. The clock runs from
``plane.start()`` until the executor has committed a core's last event.

Scenarios, same run:

- ``one core``: every event on core 0, the other cores idle;
- ``all cores``: events spread over every core; all consumers replay at once
  (they share one event loop and the GIL, so per-core rates split the box);
- ``wal read`` baseline: ``Wal.read(core=c)`` alone, one thread, no plane: the
  ceiling the consumer path is measured against.

Run: ``python -m bench.bench_consumer`` (``--events 400000`` for a quick run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import structlog

from daemon.config import Config, DaemonConfig, MicrobatchConfig, WalConfig
from daemon.plane.batch import MicroBatch
from daemon.plane.eventplane import EventPlane
from daemon.service.metrics import Metrics
from wal import Wal

TARGET_EPS = 1_000_000  # issue 3, section 7: catch-up >= 1M events/s per core


class CountingExecutor:
    """Executor that commits at once and only counts rows (and when each core ended)."""

    def __init__(self, expected: dict[int, int]) -> None:
        self.expected = expected
        self.rows = dict.fromkeys(expected, 0)
        self.finished: dict[int, float] = {}
        self.batches = 0
        self.done = asyncio.Event()

    async def start(self) -> None:
        return None

    def ready(self) -> bool:
        return True

    async def execute(self, batch: MicroBatch) -> None:
        self.batches += 1
        now = time.perf_counter()
        for core, s in batch.slices.items():
            self.rows[core] += s.rows
            if self.rows[core] >= self.expected[core] and core not in self.finished:
                self.finished[core] = now
        if len(self.finished) == len(self.expected):
            self.done.set()

    async def stop(self) -> None:
        return None


def payloads(n: int, seed: int = 11) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        doc = {
            "collection": "orders",
            "op": "update",
            "key": f"k{rng.randrange(1_000_000):07d}",
            "new": {"amount": round(rng.random() * 1000, 2), "status": "paid", "n": i},
            "old": {"status": "open"},
        }
        out.append(json.dumps(doc, separators=(",", ":")).encode())
    return out


def fill_wal(directory: Path, events: int, busy_cores: int, per_request: int = 1000) -> None:
    docs = payloads(min(events, 10_000))
    with Wal.open(directory, fsync="never") as wal:
        for start in range(0, events, per_request):
            n = min(per_request, events - start)
            wal.append_blocking(
                [((start + i) % busy_cores, docs[(start + i) % len(docs)]) for i in range(n)]
            )


def wal_read_rate(directory: Path, core: int) -> tuple[int, float]:
    with Wal.open(directory) as wal:
        started = time.perf_counter()
        n = sum(1 for _ in wal.read(1, core=core))
        return n, n / (time.perf_counter() - started)


async def catch_up(
    directory: Path, data_dir: Path, cores: int, expected: dict[int, int], last: dict[int, int]
) -> tuple[dict[int, float], dict[int, float], int]:
    """Seconds from start until each busy core (a) delivered its last event into a
    slice (caught up) and (b) had it committed by the executor; and the batch count."""
    cfg = Config(
        daemon=DaemonConfig(data_dir=data_dir, cores=cores),
        microbatch=MicrobatchConfig(),
        wal=WalConfig(),
    )
    w = cfg.wal
    wal = Wal.open(
        directory,
        segment_bytes=w.segment_bytes,
        fsync=w.fsync,
        fsync_interval_ms=w.fsync_interval_ms,
        max_group_bytes=w.max_group_bytes,
    )
    busy = {c: n for c, n in expected.items() if n}
    executor = CountingExecutor(busy)
    plane = EventPlane(cfg, wal, executor, Metrics())
    wal.set_batch_listener(plane.on_durable_batches)
    caught_up: dict[int, float] = {}

    async def watch() -> None:
        while len(caught_up) < len(busy):
            for consumer in plane.consumers:
                c = consumer.core
                if c in busy and c not in caught_up and consumer.last_lsn >= last[c]:
                    caught_up[c] = time.perf_counter() - started
            await asyncio.sleep(0.0005)

    try:
        started = time.perf_counter()
        await plane.start()
        await asyncio.wait_for(asyncio.gather(executor.done.wait(), watch()), 600)
        committed = {c: t - started for c, t in executor.finished.items()}
        await plane.stop(10)
        return caught_up, committed, executor.batches
    finally:
        await wal.aclose()


HEADER = (
    f"{'scenario':<10} {'core':>4} {'events':>10} {'caught up s':>11} {'events/s':>11} "
    f"{'>= 1M':>5} {'committed s':>11} {'events/s':>11}"
)


def run_scenario(root: Path, name: str, events: int, cores: int, busy: int) -> list[str]:
    directory = root / f"wal-{name.replace(' ', '-')}"
    fill_wal(directory, events, busy)
    # Event i has LSN i + 1 and core i % busy.
    expected = {c: len(range(c, events, busy)) if c < busy else 0 for c in range(cores)}
    last = {c: max(range(c, events, busy)) + 1 for c in range(busy)}
    baseline_n, baseline_eps = wal_read_rate(directory, 0)
    caught_up, committed, batches = asyncio.run(
        catch_up(directory, root / f"data-{name.replace(' ', '-')}", cores, expected, last)
    )
    rows = []
    for core in sorted(committed):
        n = expected[core]
        eps = n / caught_up[core]
        rows.append(
            f"{name:<10} {core:>4} {n:>10,} {caught_up[core]:>11.3f} {eps:>11,.0f} "
            f"{'yes' if eps >= TARGET_EPS else 'no':>5} {committed[core]:>11.3f} "
            f"{n / committed[core]:>11,.0f}"
        )
    total = sum(expected.values())
    t_caught, t_done = max(caught_up.values()), max(committed.values())
    rows.append(
        f"{name:<10} {'sum':>4} {total:>10,} {t_caught:>11.3f} {total / t_caught:>11,.0f} "
        f"{'':>5} {t_done:>11.3f} {total / t_done:>11,.0f}"
    )
    rows.append(
        f"{'':<10} ({batches} batches; Wal.read(core=0) alone, no plane: {baseline_eps:,.0f} "
        "events/s)"
    )
    if baseline_n != expected[0]:
        raise SystemExit(f"WAL holds {baseline_n} events of core 0, expected {expected[0]}")
    shutil.rmtree(directory)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_consumer", description=__doc__)
    parser.add_argument("--events", type=int, default=2_000_000, help="events per scenario")
    parser.add_argument("--cores", type=int, default=4, help="daemon.cores")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: tmp)")
    args = parser.parse_args(argv)
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(40), cache_logger_on_first_use=True
    )
    root = Path(tempfile.mkdtemp(prefix="bench-consumer-", dir=args.dir))
    try:
        print(
            f"consumer catch-up: {args.events:,} events of ~150 B, {args.cores} cores, "
            f"target >= {TARGET_EPS:,} events/s per core"
        )
        print(HEADER)
        for line in run_scenario(root, "one core", args.events, args.cores, 1):
            print(line, flush=True)
        for line in run_scenario(root, "all cores", args.events, args.cores, args.cores):
            print(line, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
