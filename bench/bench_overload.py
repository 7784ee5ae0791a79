"""Resident memory of the daemon under sustained overload (issue: memory is bounded).

Starts ``eventplane run`` (Spark CDC stream, local[2]) in a subprocess, offers
far more than it can commit (16 producers posting 1000-event requests as fast
as they can) for ``--seconds``, and samples the RSS of the daemon's Python
process and of its Spark JVM every few seconds. Overload must move work to
the WAL, not to RAM: the Python RSS stays flat within the configured ring and
pending-slice budgets, which the table prints beside the samples.

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

from tests.integration.harness import DaemonProcess, Loader, write_config

MiB = 1024 * 1024


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return 0
    return 0


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
        config = write_config(d, cores=4, interval_ms=1000, segment_bytes=64 * MiB, extra=extra)
        daemon = DaemonProcess.production(config).start(timeout_s=180)
        assert daemon.proc is not None
        pid = daemon.proc.pid
        while not daemon.status()["spark"]["ready"]:
            time.sleep(0.2)
        base = rss_bytes(pid)
        loaders = [
            Loader(daemon.ingest_url, batch=1000, producers=args.producers // 4) for _ in range(4)
        ]
        for lo in loaders:
            lo.start()
        samples: list[tuple[float, int, int, int, int]] = []
        t0 = time.monotonic()
        stop = threading.Event()
        while (elapsed := time.monotonic() - t0) < args.seconds and not stop.is_set():
            st = daemon.status()
            jvm = sum(rss_bytes(c) for c in children(pid))
            max_lag = max(c["lag"] for c in st["cores"])
            samples.append((elapsed, rss_bytes(pid), jvm, st["wal"]["head_lsn"], max_lag))
            time.sleep(5)
        for lo in loaders:
            lo.stop()
        daemon.stop()

    print(
        f"\nDaemon RSS under overload ({args.producers} producers x 1000-event requests,"
        f" fsync on, 4 cores, {'no executor' if args.no_spark else 'Spark local[2]'})"
    )
    print(
        f"budgets: ring {ring_capacity} events / {ring_bytes // MiB} MiB per core,"
        f" pending slices {pending // MiB} MiB per core; Python RSS before load"
        f" {base / MiB:.0f} MiB\n"
    )
    print(
        f"{'t (s)':>6} {'python RSS MiB':>15} {'JVM RSS MiB':>12} {'WAL head':>12} {'max lag':>12}"
    )
    for t, py, jvm, head, lag in samples:
        print(f"{t:6.0f} {py / MiB:15.0f} {jvm / MiB:12.0f} {head:12,} {lag:12,}")
    rss = [s[1] for s in samples[1:]] or [base]
    growth = (max(rss) - min(rss)) / MiB
    print(
        f"\npython RSS range after warm-up: {min(rss) / MiB:.0f}..{max(rss) / MiB:.0f} MiB"
        f" (spread {growth:.0f} MiB) while the backlog grew to {samples[-1][4]:,} events"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
