"""A standby's takeover (docs/operating.md, "A standby") against its peer, a
restore script on the second machine, on one SeaweedFS on loopback.

Per lease setting (``--leases ttl/skew,...``), two runs on the same load:

- **standby**: a primary (``ack = "archived"``, 4 cores, no tables) and its
  standby (``role = "standby"``). An open loop at ``--rate`` events/s to the
  primary for ``--duration`` s: the standby's lag (``follow.lag_lsns`` and
  ``lag_s`` from its status, sampled every 0.2 s) and the CPU-seconds of each
  process. Then keyed producers given both endpoints (``SyncIngestClient``),
  the primary SIGKILLed: the time to the first ack from the standby.
- **restore script** (the peer a user writes without a standby): the same
  load on a primary, SIGKILL, then on a fresh data_dir ``until eventplane
  restore --config F; do sleep 1; done; eventplane run``: the time to the
  first ack (a restore is refused while the dead primary's lease is live).

    python -m bench.bench_takeover --leases 30/5,10/2 --rate 20000 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.bench_ingest import _free_port, make_bodies, open_loop
from bench.common import cpu_seconds, start_daemon

PER_REQUEST = 100


class Daemon:
    """One ``eventplane run`` on the archive ``prefix``; ``role`` primary or standby."""

    def __init__(self, root: Path, name: str, server: Any, prefix: str, lease: str, role: str):
        ttl, skew = lease.split("/")
        self.dir = root / name
        self.dir.mkdir()
        self.ingest, self.admin = _free_port(), _free_port()
        self.config = self.dir / "config.toml"
        self.config.write_text(
            f'[daemon]\ndata_dir = "data"\ncores = 4\n'
            f'[ingest]\nlisten = "127.0.0.1:{self.ingest}"\n'
            f'[admin]\nlisten = "127.0.0.1:{self.admin}"\n'
            '[log]\nlevel = "warning"\nformat = "json"\n'
            f'[s3]\nendpoint = "{server.endpoint}"\npath_style = true\n'
            f'access_key_id = "{server.access_key}"\n'
            f'secret_access_key = "{server.secret_key}"\n'
            f"lease_ttl_s = {ttl}\nlease_skew_s = {skew}\n"
            # One request with its retries inside the lease window (config check).
            "connect_timeout_s = 1\nrequest_timeout_s = 2\nmax_retries = 1\n"
            f'[wal.archive]\nuri = "s3://{server.bucket}/{prefix}"\n'
            f'ack = "archived"\nrole = "{role}"\n'
        )
        self.url = f"http://127.0.0.1:{self.ingest}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.keyed = False  # what bench_ingest's open loop asks of a server

    def start(self) -> Daemon:
        self.proc = start_daemon(self.dir, self.admin, f"the {self.dir.name} daemon", "/healthz")
        return self

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/v1/status", timeout=5) as r:
            doc: dict[str, Any] = json.loads(r.read())
            return doc

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Failover(threading.Thread):
    """Keyed producers given both endpoints: when each ack came, and from where."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(daemon=True)
        self.urls = urls
        self.acks: list[tuple[float, str]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        from daemon.client import SyncIngestClient

        body = make_bodies(1, PER_REQUEST, seed=11)[0]
        with SyncIngestClient(endpoints=self.urls, retry_for_s=300, max_wait_s=0.5) as client:
            while not self.halt.is_set():
                client.send_ndjson(body)
                self.acks.append((time.monotonic(), client.url))
                self.halt.wait(0.01)

    def first_ack_at(self, url: str, after: float) -> float | None:
        times = [t for t, where in self.acks if t > after and where.startswith(url)]
        return min(times) if times else None


def load(daemon: Daemon, rate: float, duration_s: float) -> float:
    """The open loop at ``rate`` to ``daemon``; the events/s it acknowledged
    (its WAL head's move over the loop's wall time, drain included)."""
    bodies = make_bodies(64, PER_REQUEST)
    target: Any = argparse.Namespace(url=daemon.url + "/v1/events", keyed=False)
    head, t0 = daemon.status()["wal"]["head_lsn"], time.monotonic()
    asyncio.run(open_loop(target, bodies, 64, rate, duration_s))
    return float(daemon.status()["wal"]["head_lsn"] - head) / (time.monotonic() - t0)


def wait_first_ack(producers: Failover, url: str, after: float, limit_s: float) -> float:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = producers.first_ack_at(url, after)
        if got is not None:
            return got - after
        time.sleep(0.05)
    raise RuntimeError(f"no ack from {url} within {limit_s} s")


def standby_run(root: Path, server: Any, lease: str, args: argparse.Namespace) -> dict[str, float]:
    prefix = f"standby-{lease.replace('/', '-')}"
    primary = Daemon(root / prefix, "primary", server, prefix, lease, "primary")
    standby = Daemon(root / prefix, "standby", server, prefix, lease, "standby")
    try:
        primary.start()
        standby.start()
        assert primary.proc is not None and standby.proc is not None
        samples: list[tuple[int, float]] = []
        halt = threading.Event()

        def sample() -> None:
            while not halt.wait(0.2):
                follow = standby.status()["standby"]["follow"]
                samples.append((int(follow["lag_lsns"]), float(follow["lag_s"])))

        sampler = threading.Thread(target=sample, daemon=True)
        cpu0 = (cpu_seconds(primary.proc.pid), cpu_seconds(standby.proc.pid))
        sampler.start()
        achieved = load(primary, args.rate, args.duration)
        halt.set()
        sampler.join()
        cpu1 = (cpu_seconds(primary.proc.pid), cpu_seconds(standby.proc.pid))
        producers = Failover([primary.url, standby.url])
        producers.start()
        time.sleep(1.0)
        killed = time.monotonic()
        primary.proc.kill()
        primary.proc.wait()
        took = wait_first_ack(producers, standby.url, killed, 120)
        producers.halt.set()
        producers.join(30)
        lags = sorted(lsns for lsns, _ in samples)
        secs = sorted(s for _, s in samples)
        return {
            "first_ack_s": took,
            "events_per_s": achieved,
            "lag_p50": lags[len(lags) // 2],
            "lag_p99": lags[min(len(lags) - 1, int(len(lags) * 0.99))],
            "lag_s_max": secs[-1],
            "primary_cpu": cpu1[0] - cpu0[0],
            "standby_cpu": cpu1[1] - cpu0[1],
        }
    finally:
        primary.stop()
        standby.stop()


def script_run(root: Path, server: Any, lease: str, args: argparse.Namespace) -> dict[str, float]:
    prefix = f"script-{lease.replace('/', '-')}"
    primary = Daemon(root / prefix, "primary", server, prefix, lease, "primary")
    try:
        primary.start()
        assert primary.proc is not None
        cpu0 = cpu_seconds(primary.proc.pid)
        achieved = load(primary, args.rate, args.duration)
        cpu = cpu_seconds(primary.proc.pid) - cpu0
        producers = Failover([primary.url])
        producers.start()
        time.sleep(1.0)
        killed = time.monotonic()
        primary.proc.kill()
        primary.proc.wait()
        # The script on the second machine: the same config, its own empty data_dir
        # (another path: the dead primary's lease is not taken as its own restart).
        second = primary.dir.parent / "second"
        second.mkdir()
        shutil.copy(primary.config, second / "config.toml")
        cmd = [sys.executable, "-m", "daemon.cli.main", "restore", "--config", "config.toml"]
        restores = 0
        while True:
            restores += 1
            got = subprocess.run(cmd, cwd=second, capture_output=True, check=False)
            if got.returncode == 0:
                break
            time.sleep(1.0)
        primary.dir = second
        primary.start()
        took = wait_first_ack(producers, primary.url, killed, 120)
        producers.halt.set()
        producers.join(30)
        return {
            "first_ack_s": took,
            "events_per_s": achieved,
            "primary_cpu": cpu,
            "tries": restores,
        }
    finally:
        primary.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", default="30/5,10/2", help="lease_ttl_s/lease_skew_s,...")
    parser.add_argument("--rate", type=float, default=20_000)
    parser.add_argument("--duration", type=float, default=10.0)
    args = parser.parse_args(argv)
    from tests.s3.server import start_weed

    root = Path(tempfile.mkdtemp(prefix="bench-takeover-"))
    (root / "weed").mkdir()
    weed = start_weed(root / "weed")
    print(
        "| lease ttl/skew | side | kill to first ack s | aim s | events/s | standby lag p50/p99 "
        "LSNs | lag max s | primary CPU s | standby CPU s | standby/primary CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    try:
        for lease in args.leases.split(","):
            (root / f"standby-{lease.replace('/', '-')}").mkdir()
            (root / f"script-{lease.replace('/', '-')}").mkdir()
            ttl, skew = (float(x) for x in lease.split("/"))
            aim = ttl + skew + 5
            s = standby_run(root, weed.server, lease, args)
            print(
                f"| {lease} | standby | {s['first_ack_s']:.1f} | {aim:g} "
                f"| {s['events_per_s']:,.0f} | {s['lag_p50']:,.0f} / {s['lag_p99']:,.0f} "
                f"| {s['lag_s_max']:.2f} | {s['primary_cpu']:.1f} | {s['standby_cpu']:.1f} "
                f"| {s['standby_cpu'] / max(s['primary_cpu'], 1e-9):.0%} |",
                flush=True,
            )
            p = script_run(root, weed.server, lease, args)
            print(
                f"| {lease} | restore script ({p['tries']:.0f} tries) | {p['first_ack_s']:.1f} "
                f"| - | {p['events_per_s']:,.0f} | - | - | {p['primary_cpu']:.1f} | - | - |",
                flush=True,
            )
            print(
                f"| {lease} | ratio standby / script | "
                f"{s['first_ack_s'] / p['first_ack_s']:.2f} | | | | | | | |",
                flush=True,
            )
    finally:
        weed.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
