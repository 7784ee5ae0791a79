"""A stand-alone executor that loses its Spark session twice and rebuilds it.

``python -m tests.spark.jvm_worker ROOT`` runs the deterministic batches 1..3
of ``tests.spark.support`` through a real ``SparkExecutor`` (``local[1]``, a
session it builds and owns) writing under ROOT, and prints one JSON line per
step:

1. batch 1 commits;
2. the driver JVM is SIGKILLed; batch 2 fails, the session is rebuilt on a
   new JVM, batch 2 runs again and commits;
3. the new JVM's SparkContext is stopped from the JVM side (what a cluster
   driver does when its master is gone for good) while the JVM lives on;
   batch 3 fails, the session is rebuilt, batch 3 runs again and commits.

A subprocess, because a process has one SparkContext: the test session's
must not be the one that dies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from daemon.plane.batch import MicroBatch
from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from tests.spark.support import make_batches, make_config


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def jvm_pid(ex: SparkExecutor) -> int:
    return int(ex.session.sparkContext._gateway.proc.pid)


async def run_until_committed(ex: SparkExecutor, batch: MicroBatch, timeout_s: float) -> list[str]:
    """What the planner does: retry the batch whole, waiting while Spark is not ready."""
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await ex.execute(batch)
            return errors
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)
        await asyncio.wait_for(ex.wait_ready(), max(deadline - time.monotonic(), 1.0))


async def run(args: argparse.Namespace) -> int:
    cfg = make_config(Path(args.root), master="local[1]")
    ex = SparkExecutor(cfg, Metrics(), wal_id="wal-1")
    await ex.start()
    b1, b2, b3 = make_batches(3, args.per_batch)
    try:
        await asyncio.wait_for(ex.wait_ready(), args.timeout)
        await ex.execute(b1)
        first = jvm_pid(ex)
        emit(step=1, committed=1, pid=first)

        # Step 2. SIGKILL the driver JVM.
        os.kill(first, signal.SIGKILL)
        started = time.monotonic()
        errors = await run_until_committed(ex, b2, args.timeout)
        second = jvm_pid(ex)
        emit(
            step=2,
            committed=2,
            pid=second,
            old_pid_gone=gone(first),
            seconds=round(time.monotonic() - started, 1),
            errors=errors,
            status=ex.status(),
        )

        # Step 3. Stop the SparkContext inside the JVM; the JVM itself lives on.
        ex.session.sparkContext._jsc.sc().stop()
        started = time.monotonic()
        errors = await run_until_committed(ex, b3, args.timeout)
        emit(
            step=3,
            committed=3,
            pid=jvm_pid(ex),
            old_pid_gone=gone(second),
            seconds=round(time.monotonic() - started, 1),
            errors=errors,
            status=ex.status(),
        )
    finally:
        await ex.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--per-batch", type=int, default=150)
    p.add_argument("--timeout", type=float, default=240.0)
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
