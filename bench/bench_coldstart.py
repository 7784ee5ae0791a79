"""A daemon's cold start: Spark ready, then its first batch, with its JVM's CPU.

``python -m bench.bench_coldstart [ROOT [LABEL ['TOML lines for [spark]']]] [--src DIR]
[--format parquet|delta]``

Starts ``eventplane run`` on a new ``data_dir`` under ROOT whose
``spark-cds`` folder is ROOT/cds, shared by every start under ROOT (as one
daemon restarted on its ``data_dir`` shares its class data sharing archive),
waits until ``/v1/status`` says Spark is ready, posts one request of 1000
events (``bench_cdc``'s), waits until the CDC ledger has committed them, stops
the daemon and waits for its JVM to exit. Prints one line: the time to ready
and the JVM's CPU then, the first batch's time from its post and the JVM's
CPU for it, the resident memory (RSS) of the daemon and its JVM then, and the
JVM's exit time (which includes writing the archive the first time).
Without ROOT: one start in a temp folder, removed afterwards.
``--src``: run the daemon from that source tree (an older commit, unpacked);
its config must then know the lines given. ``--format``: the stream's
``format`` line (default: none, the config's default). Results:
docs/performance.md, "The daemon's JVM".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench.bench_cdc import _free_port, _ledger_state, _ndjson
from bench.bench_pipeline import own_cpu, tree_cpu
from bench.jvm_threads import find_jvm

CONFIG = """
[daemon]
data_dir = "data"
cores = 2
[ingest]
listen = "127.0.0.1:{ingest}"
[admin]
listen = "127.0.0.1:{admin}"
[spark]
master = "local[*]"
log_level = "ERROR"
{spark}
[spark.conf]
"spark.sql.shuffle.partitions" = "4"
[log]
level = "warning"
format = "json"
[[cdc.streams]]
name = "all"
collections = "*"
path = "cdc"
{format}"""


def tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and every live descendant (the daemon and its JVM)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/statm") as f:
            total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        todo.extend(children.get(pid, ()))
    return total


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_coldstart", description=__doc__)
    p.add_argument("root", type=Path, nargs="?", help="starts under one ROOT share an archive")
    p.add_argument("label", nargs="?", default="start")
    p.add_argument("spark", nargs="?", default="", help="more lines of the [spark] section")
    p.add_argument("--src", type=Path, help="run the daemon from this source tree")
    p.add_argument("--format", choices=("parquet", "delta"), help="the stream's format line")
    args = p.parse_args(argv)
    if args.root is None:
        with tempfile.TemporaryDirectory(prefix="bench-coldstart-") as tmp:
            src = ["--src", str(args.src)] if args.src else []
            fmt = ["--format", args.format] if args.format else []
            return main([tmp, args.label, args.spark, *src, *fmt])
    run = args.root / f"{args.label}-{time.time_ns()}"
    (run / "data").mkdir(parents=True)
    (args.root / "cds").mkdir(exist_ok=True)
    (run / "data" / "spark-cds").symlink_to((args.root / "cds").resolve())
    ingest, admin = _free_port(), _free_port()
    config = run / "config.toml"
    fmt = f'format = "{args.format}"\n' if args.format else ""
    config.write_text(CONFIG.format(ingest=ingest, admin=admin, spark=args.spark, format=fmt))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    started = time.monotonic()
    with open(run / "daemon.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli.main", "run", "--config", str(config)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=args.src,
        )  # fmt: skip
    try:
        while True:
            if proc.poll() is not None:
                print((run / "daemon.log").read_text(errors="replace")[-3000:], file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/v1/status", timeout=2) as r:
                    if json.load(r).get("spark", {}).get("ready"):
                        break
            except OSError:
                pass
            time.sleep(0.05)
        ready_s = time.monotonic() - started
        cpu_ready = tree_cpu(proc.pid) - own_cpu(proc.pid)
        posted = time.monotonic()
        request = urllib.request.Request(
            f"http://127.0.0.1:{ingest}/v1/events",
            data=_ndjson(1, 1000)[0],
            headers={"content-type": "application/x-ndjson"},
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            r.read()
        while _ledger_state(run / "cdc")[0] < 1000:
            time.sleep(0.01)
        first_s = time.monotonic() - posted
        total_s = time.monotonic() - started
        cpu_first = tree_cpu(proc.pid) - own_cpu(proc.pid)
        rss = tree_rss(proc.pid)
        jvm = find_jvm(proc.pid)
        with open(f"/proc/{jvm}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace").split("\0")
        cds = [a.split("=")[0] for a in cmdline if a.startswith("-XX:") and "Archive" in a]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    stopped = time.monotonic()
    while jvm is not None and os.path.exists(f"/proc/{jvm}") and time.monotonic() - stopped < 120:
        time.sleep(0.1)
    print(
        f"{args.label}: ready after {ready_s:.2f} s (JVM CPU {cpu_ready:.2f} s); first batch "
        f"visible {first_s:.2f} s after its post, {total_s:.2f} s after the start (JVM CPU "
        f"+{cpu_first - cpu_ready:.2f} s, {cpu_first:.2f} s in all); RSS {rss / 2**20:.0f} MiB "
        f"then; JVM exited {time.monotonic() - stopped:.1f} s after the daemon; archive "
        f"options {cds or 'none'}; load average {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
