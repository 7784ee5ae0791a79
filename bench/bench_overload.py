"""Resident memory of the daemon under sustained overload (issue: memory is bounded).

Starts ``eventplane run`` (Spark CDC stream, local[2]) in a subprocess, offers
far more than it can commit (16 producers posting 1000-event requests as fast
as they can) for ``--seconds``, and samples the resident memory of the
daemon's Python process (anonymous and file-backed apart) and of its Spark
JVM every few seconds. Overload must move work to the WAL, not to RAM: the
anonymous RSS levels off within the configured budgets (rings, pending and
running slices, the executor's batch build, ingest bodies, one WAL group),
whatever the backlog.

Columns: ``held`` is what rings, pending and running slices hold by the
daemon's own count (``/v1/status``); ``other`` is the anonymous RSS beyond the
idle daemon and ``held``: the executor's build, ingest, allocator slack.

    python -m bench.bench_overload [--seconds 60]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from daemon.plane.parts import COLUMNAR_OVERHEAD_BYTES, PART_OVERHEAD_BYTES
from daemon.spark.frame import BUILD_MAX_BYTES
from tests.integration.harness import DaemonProcess, Loader, write_config

MiB = 1024 * 1024
# What a ring entry may hold beyond its payload. Rings hold runs (one per core
# and WAL group): ~17 B per event (the LSN and offset arrays, over-allocated by
# ~1/16) plus ~0.35-0.5 KiB per run (the RecordBatch, its arrays' headers, the
# joined payload's bytes header, the deque slot). Measured with real runs
# through RingSet.push_batches until 4 rings held 65,536 events each: 369 B per
# entry (tracemalloc), 391 B (RssAnon) with one-event runs; 18-20 B with runs
# of 256-1024 events. The budget takes the one-event case, which a trickle of
# small requests gives (tests/core/test_ring.py checks the bound), not this
# load's runs of hundreds of events.
RING_ENTRY_MAX_BYTES = COLUMNAR_OVERHEAD_BYTES + PART_OVERHEAD_BYTES


def memory(pid: int) -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of ``pid``.

    File-backed pages are mapped WAL segments (catch-up reads them through
    mmap) and shared libraries: page cache the kernel reclaims at will. The
    budgets bound the anonymous part.
    """
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    except FileNotFoundError:
        return 0, 0
    return fields.get("RssAnon", 0), fields.get("RssFile", 0) + fields.get("RssShmem", 0)


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--producers", type=int, default=16)
    ap.add_argument(
        "--no-spark",
        action="store_true",
        help="no CDC stream: batches commit at once (the floor without the executor)",
    )
    args = ap.parse_args(argv)

    ring_capacity, ring_bytes, pending = 65_536, 16 * MiB, 64 * MiB
    # Writing a batch's inbox file holds microbatch.build_max_bytes of Arrow
    # data; measured resident: 41-45 MiB for the 16 MiB default (Arrow's pool
    # purging freed pages at once, as the daemon sets it up).
    build = 3 * BUILD_MAX_BYTES
    # Request bodies read or parsed at once, and one WAL group commit: the
    # ingest side's own bounds, configured here so the budget line is exact.
    buffered, group = 64 * MiB, 8 * MiB
    with tempfile.TemporaryDirectory(prefix="ep-overload-") as tmp:
        d = Path(tmp)
        extra = f"""
[consumer]
ring_max_bytes = {ring_bytes}
pending_max_bytes = {pending}

[spark]
master = "local[2]"
log_level = "ERROR"
"""
        if not args.no_spark:
            extra += f"""
[[cdc.streams]]
name = "all"
collections = "*"
path = "{d / "cdc"}"
"""
        config = write_config(
            d,
            cores=4,
            interval_ms=1000,
            segment_bytes=64 * MiB,
            ingest=f"max_buffered_bytes = {buffered}",
            wal=f"max_group_bytes = {group}",
            extra=extra,
        )
        daemon = DaemonProcess.production(config).start(timeout_s=180)
        assert daemon.proc is not None
        pid = daemon.proc.pid
        while not daemon.status()["spark"]["ready"]:
            time.sleep(0.2)
        base, _ = memory(pid)
        loaders = [
            Loader(daemon.ingest_url, batch=1000, producers=args.producers // 4) for _ in range(4)
        ]
        for lo in loaders:
            lo.start()
        samples: list[tuple[float, int, int, int, int, int, int]] = []
        t0 = time.monotonic()
        stop = threading.Event()
        while (elapsed := time.monotonic() - t0) < args.seconds and not stop.is_set():
            st = daemon.status()
            jvm = sum(sum(memory(c)) for c in children(pid))
            max_lag = max(c["lag"] for c in st["cores"])
            anon, file = memory(pid)
            # The per-run part of a ring entry is left out (status does not count
            # runs): this load's runs hold hundreds of events, under 2 B each.
            held = sum(
                c["ring"]["bytes"]
                + c["ring"]["events"] * COLUMNAR_OVERHEAD_BYTES
                + c["pending_bytes"]
                + c["inflight_bytes"]
                for c in st["cores"]
            )
            samples.append((elapsed, anon, file, jvm, st["wal"]["head_lsn"], max_lag, held))
            time.sleep(5)
        for lo in loaders:
            lo.stop()
        daemon.stop()

    print(
        f"\nDaemon RSS under overload ({args.producers} producers x 1000-event requests,"
        f" fsync on, 4 cores, {'no executor' if args.no_spark else 'Spark local[2]'})"
    )
    cores = 4
    cores_budget = cores * (ring_bytes + ring_capacity * RING_ENTRY_MAX_BYTES + pending)
    budget = cores_budget + build + buffered + group
    print(
        f"budgets per core: ring {ring_capacity} events / {ring_bytes // MiB} MiB,"
        f" pending + running slices {pending // MiB} MiB; all cores, with"
        f" up to {RING_ENTRY_MAX_BYTES} B per ring entry (one-event runs):"
        f" {cores_budget / MiB:.0f} MiB;"
        f" batch build {build / MiB:.0f} MiB, ingest bodies {buffered // MiB} MiB,"
        f" WAL group {group // MiB} MiB; in all {budget / MiB:.0f} MiB."
        f" Anonymous RSS before load {base / MiB:.0f} MiB\n"
        "held = what rings, pending and running slices hold by the daemon's own count;"
        " other = anon - before load - held\n"
    )
    print(
        f"{'t (s)':>6} {'anon MiB':>9} {'held MiB':>9} {'other MiB':>10} {'file MiB':>9}"
        f" {'JVM RSS MiB':>12} {'WAL head':>12} {'max lag':>12}"
    )
    for t, anon, file, jvm, head, lag, held in samples:
        other = anon - base - held
        print(
            f"{t:6.0f} {anon / MiB:9.0f} {held / MiB:9.0f} {other / MiB:10.0f} {file / MiB:9.0f}"
            f" {jvm / MiB:12.0f} {head:12,} {lag:12,}"
        )
    thirds = [samples[i * len(samples) // 3 : (i + 1) * len(samples) // 3] for i in range(3)]
    peaks = [max(s[1] for s in part) / MiB if part else 0.0 for part in thirds]
    growth = max(s[1] for s in samples) - base
    print(
        f"\nanonymous RSS peak per third of the run: {peaks[0]:.0f} / {peaks[1]:.0f} /"
        f" {peaks[2]:.0f} MiB; growth over the idle daemon {growth / MiB:.0f} MiB ="
        f" {growth / budget:.2f}x the budgets, while the backlog reached {samples[-1][5]:,}"
        " events"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
