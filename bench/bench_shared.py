"""Several daemons, one lake: 1, 2 and 3 daemons appending to one shared Delta table.

Per daemon count N: N daemons (``eventplane run``, each its own data_dir, WAL
and ``[daemon] name``, embedded Spark ``local[1]``), one ``writers = "shared"``
stream on this disk (or with ``--s3`` on SeaweedFS on loopback, behind a proxy
that counts the HTTP requests the daemons make). Producers use the client a
user would (``IngestClient(endpoints=[...], route="key")``: each key to one
daemon) in a closed loop of 1000-event requests for ``--duration`` seconds;
then the run waits until the table holds every acknowledged event (read with
delta-rs). The peer is one daemon, the same client and data: the ratio
column is N daemons' end-to-end rate over one daemon's.

Reported: acknowledged events/s, end-to-end events/s (from the first request
to the last acknowledged event queryable), CPU-seconds of the daemons (with
their JVMs) and of the producers, CPU-µs per event, Delta commits, commit
retries (``eventplane_cdc_commit_retries_total``: appends that lost their
version to another daemon's commit), S3 requests per commit (``--s3``).

Run: ``python -m bench.bench_shared`` (``--daemons 1,2`` ``--duration 10``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import resource
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.bench_ingest import _free_port
from bench.bench_s3 import CountingProxy
from bench.common import process_tree, start_daemon, stop_process, total_cpu_seconds

EVENTS_PER_REQUEST = 1000
KEYS = 100_000


def table_setting(uri: str) -> str:
    """The stream's location line: a folder or an ``s3://`` URI, both ``path``."""
    return f'path = "{uri}"'


class Daemon:
    def __init__(self, root: Path, n: int, table: str, s3: str) -> None:
        self.name = f"ep-{n}"
        self.dir = root / self.name
        self.dir.mkdir()
        ingest, self.admin = _free_port(), _free_port()
        text = (
            f'[daemon]\nname = "{self.name}"\ndata_dir = "data"\ncores = 2\n'
            f'[ingest]\nlisten = "127.0.0.1:{ingest}"\n'
            f'[admin]\nlisten = "127.0.0.1:{self.admin}"\n'
            '[log]\nlevel = "warning"\nformat = "json"\n'
            "[microbatch]\ninterval_ms = 500\n"
            '[spark]\nmaster = "local[1]"\nlog_level = "ERROR"\n'
            '[spark.conf]\n"spark.sql.shuffle.partitions" = "1"\n'
            f"{s3}"
            '[[cdc.streams]]\nname = "all"\ncollections = "*"\n'
            f'{table}\nwriters = "shared"\n'
        )
        (self.dir / "config.toml").write_text(text)
        self.url = f"http://127.0.0.1:{ingest}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = start_daemon(self.dir, self.admin, f"daemon {self.name}")

    def pids(self) -> list[int]:
        assert self.proc is not None
        return process_tree(self.proc.pid)

    def retries(self) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("eventplane_cdc_commit_retries_total")
        )

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 30)


def bodies(count: int, seed: int) -> list[bytes]:
    """``count`` NDJSON bodies of 1000 keyed update events (~150 bytes each)."""
    import random

    import msgspec

    rng = random.Random(seed)
    enc = msgspec.json.Encoder()
    out = []
    for b in range(count):
        lines = []
        for i in range(EVENTS_PER_REQUEST):
            key = f"k{rng.randrange(KEYS)}"
            lines.append(
                enc.encode(
                    {
                        "collection": f"c{rng.randrange(4)}",
                        "key": key,
                        "op": "update",
                        "new": {"n": b * EVENTS_PER_REQUEST + i, "status": "placed", "v": 1.5},
                    }
                )
            )
        out.append(b"\n".join(lines) + b"\n")
    return out


async def produce(urls: list[str], data: list[bytes], clients: int, duration_s: float) -> int:
    """Acknowledged events from ``clients`` back-to-back producers (route="key")."""
    from daemon.client import IngestClient

    stop_at = time.monotonic() + duration_s
    acked = 0

    async def producer(i: int) -> None:
        nonlocal acked
        client = IngestClient(endpoints=urls, route="key", timeout_s=30.0)
        try:
            k = i
            while time.monotonic() < stop_at:
                ack = await client.send_ndjson(data[k % len(data)])
                acked += ack.accepted
                k += clients
        finally:
            await client.close()

    await asyncio.gather(*(producer(i) for i in range(clients)))
    return acked


def table_rows(uri: str, options: dict[str, str] | None) -> tuple[int, int]:
    """(rows, commits) of the Delta table, as delta-rs reads it now."""
    from deltalake import DeltaTable

    try:
        dt = DeltaTable(uri, storage_options=options)
    except Exception:
        return 0, 0
    rows = int(dt.to_pyarrow_dataset().count_rows())
    return rows, dt.version()


def wait_rows(uri: str, options: dict[str, str] | None, want: int, what: str) -> None:
    """Until the table holds ``want`` rows (every acknowledged event), 300 s at most."""
    deadline = time.monotonic() + 300
    rows = 0
    while rows < want and time.monotonic() < deadline:
        time.sleep(0.1)
        rows, _ = table_rows(uri, options)
    if rows < want:
        raise RuntimeError(f"{what}: the table holds {rows} of {want} acknowledged events")
    if rows > want:
        raise RuntimeError(f"{what}: the table holds {rows} rows, {want} acknowledged")


def one_run(n: int, args: argparse.Namespace, root: Path, weed: Any) -> dict[str, float]:
    base = root / f"n{n}"
    base.mkdir()
    proxy = None
    if weed is not None:
        server = weed.server
        proxy = CountingProxy(server.endpoint)
        proxy.start()
        uri = f"s3://{server.bucket}/shared-{n}-{time.monotonic_ns()}"
        s3 = (
            f'[s3]\nendpoint = "{proxy.endpoint}"\npath_style = true\n'
            f'access_key_id = "{server.access_key}"\nsecret_access_key = "{server.secret_key}"\n'
        )
        options = server.storage_options()
    else:
        uri, s3, options = str(base / "table"), "", None
    table = table_setting(uri)
    daemons = [Daemon(base, i + 1, table, s3) for i in range(n)]
    try:
        for d in daemons:
            d.start()
        data = bodies(32, seed=n)
        urls = [d.url for d in daemons]
        # Warm-up: every daemon's Spark and first commit, out of the figures.
        warm = asyncio.run(produce(urls, data, len(daemons) * 2, 1.0))
        wait_rows(uri, options, warm, f"{n} daemon(s), warm-up")
        pids = [p for d in daemons for p in d.pids()]
        cpu0 = total_cpu_seconds(pids)
        me0 = resource.getrusage(resource.RUSAGE_SELF)
        requests0 = len(proxy.requests) if proxy else 0
        _, version0 = table_rows(uri, options)
        t0 = time.monotonic()
        acked = asyncio.run(produce(urls, data, args.clients, args.duration))
        t_acked = time.monotonic()
        wait_rows(uri, options, warm + acked, f"{n} daemon(s)")
        t_rows = time.monotonic()
        pids = [p for d in daemons for p in d.pids()]
        cpu = total_cpu_seconds(pids) - cpu0
        me1 = resource.getrusage(resource.RUSAGE_SELF)
        producer_cpu = (me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime)
        _, version1 = table_rows(uri, options)
        commits = max(version1 - version0, 1)
        return {
            "daemons": n,
            "acked": acked,
            "acked_per_s": acked / (t_acked - t0),
            "e2e_per_s": acked / (t_rows - t0),
            "lag_s": t_rows - t_acked,
            "wall_s": t_rows - t0,
            "daemon_cpu_s": cpu,
            "producer_cpu_s": producer_cpu,
            "cpu_us": cpu * 1e6 / max(acked, 1),
            "commits": commits,
            "retries": sum(d.retries() for d in daemons),
            "s3_per_commit": (len(proxy.requests) - requests0) / commits if proxy else math.nan,
        }
    finally:
        for d in daemons:
            d.stop()
        if proxy is not None:
            proxy.stop()


def render(rows: list[dict[str, float]], args: argparse.Namespace, where: str) -> str:
    one = next((r for r in rows if r["daemons"] == 1), None)
    out = [
        f'bench_shared: {where}, {args.clients} producers (route="key"), {args.duration:g} s, '
        f"load {os.getloadavg()[0]:.1f}",
        "",
        "| daemons | acked events/s | end-to-end events/s | ratio to 1 | rows lag s | "
        "daemon CPU s | producer CPU s | daemon CPU µs/event | commits | retries | "
        "S3 requests/commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["e2e_per_s"] / one["e2e_per_s"] if one else float("nan")
        out.append(
            f"| {r['daemons']:.0f} | {r['acked_per_s']:,.0f} | {r['e2e_per_s']:,.0f} | "
            f"{ratio:.2f} | {r['lag_s']:.1f} | {r['daemon_cpu_s']:.1f} | "
            f"{r['producer_cpu_s']:.1f} | {r['cpu_us']:.1f} | {r['commits']:.0f} | "
            f"{r['retries']:.0f} | {r['s3_per_commit']:.1f} |"
        )
    if one:
        cores = one["daemon_cpu_s"] / one["wall_s"]  # what one daemon kept busy
        out += [
            "",
            f"Projection: one daemon kept {cores:.2f} cores busy for "
            f"{one['e2e_per_s']:,.0f} events/s end to end; at that cost a 16-core machine "
            f"runs about {16 / cores:.0f} daemons ({16 / cores * one['e2e_per_s']:,.0f} "
            "events/s), if its disk, its store and its producers keep up.",
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--daemons", default="1,2,3")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--s3", action="store_true", help="the table on SeaweedFS")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.daemons.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as tmp:
        root = Path(tmp)
        weed = None
        if args.s3:
            from tests.s3.server import start_weed

            (root / "weed").mkdir()
            weed = start_weed(root / "weed")
        try:
            rows = [one_run(n, args, root, weed) for n in counts]
        finally:
            if weed is not None:
                weed.stop()
    print(render(rows, args, "SeaweedFS on loopback" if args.s3 else "local disk"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
