"""A stand-alone executor process for crash and cluster tests.

``python -m tests.spark.crash_worker ROOT --batches N --per-batch M [--master URL |
--remote sc://...] [--bad-every K] [--format delta] [--s3 JSON]`` runs the deterministic
batches 1..N of ``tests.spark.support`` through a real ``SparkExecutor``
writing under ROOT, printing ``committed <id>`` after each. With
``EVENTPLANE_CRASH_AT`` set it SIGKILLs itself at that point.
``--pause-before B`` prints ``paused B`` and waits for a line on stdin before
batch B; ``--retries N`` retries a failed batch (once the executor is ready again)
like the planner does. ``--daemon-name NAME --tables DIR``: the stream is
``writers = "shared"`` (its table on disk under DIR unless ``--s3``), and the
worker prints ``retries <n>`` (eventplane_cdc_commit_retries_total) at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from daemon.config import S3Config
from daemon.errors import ExecutorError
from daemon.plane.batch import InFlight
from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from tests.spark.support import make_batches, make_config, say


async def run(args: argparse.Namespace) -> int:
    options: dict[str, Any] | None = {"format": args.format} if args.format != "parquet" else None
    if args.s3:  # {"uri": ..., "s3": {the [s3] section}}
        raw = json.loads(args.s3)
        options = {**(options or {}), "uri": raw["uri"], "s3": S3Config(**raw["s3"])}
    if args.daemon_name:
        options = {**(options or {}), "writers": "shared"}
    cfg = make_config(
        Path(args.root),
        master=args.master,
        remote=args.remote,
        stream_options=options,
        daemon_name=args.daemon_name,
        tables=Path(args.tables) if args.tables else None,
    )
    metrics = Metrics()
    ex = SparkExecutor(cfg, metrics, wal_id=args.wal_id)
    await ex.start()
    try:
        await asyncio.wait_for(ex.wait_ready(), args.ready_timeout)
        say("ready")
        for batch in make_batches(args.batches, args.per_batch, bad_every=args.bad_every):
            if args.pause_before == batch.batch_id:
                # The test restarts the server meanwhile, then writes a line.
                say(f"paused {batch.batch_id}")
                await asyncio.to_thread(sys.stdin.readline)
            for attempt in range(1, args.retries + 2):
                try:
                    await _executed(ex, batch)
                    break
                except Exception as exc:  # the planner's retry, in short
                    say(f"failed {batch.batch_id} attempt {attempt}: {exc!r}"[:300])
                    if attempt > args.retries:
                        raise
                    await asyncio.sleep(1.0)
                    await asyncio.wait_for(ex.wait_ready(), args.ready_timeout)
            say(f"committed {batch.batch_id}")
        if args.daemon_name:
            say(f"retries {int(metrics.cdc_commit_retries.labels('all')._value.get())}")
    finally:
        await ex.stop()
    return 0


async def _executed(ex: SparkExecutor, batch: Any) -> None:
    """``ex.execute(batch)`` as the planner takes it: a stage's failure raises,
    and a commit that outlived the wait (``InFlight``) is waited for, so
    ``committed <id>`` is printed only once the batch is in every table and the
    next batch never runs beside it."""
    for stage, outcome in (await ex.execute(batch)).items():
        if isinstance(outcome, InFlight):
            await asyncio.wrap_future(outcome.done)  # raises the commit's error
        else:
            raise ExecutorError(f"batch {batch.batch_id}: stage {stage} failed: {outcome!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--per-batch", type=int, default=200)
    p.add_argument("--master", default="local[1]")
    p.add_argument("--remote", default="")
    p.add_argument("--wal-id", default="wal-1")
    p.add_argument("--ready-timeout", type=float, default=240.0)
    p.add_argument("--retries", type=int, default=0, help="failed attempts retried per batch")
    p.add_argument("--bad-every", type=int, default=0, help="every Nth LSN's payload is bad")
    p.add_argument("--format", default="parquet", help="the stream's table format")
    p.add_argument("--s3", default="", help='the table on S3: {"uri": ..., "s3": {...}}')
    p.add_argument("--daemon-name", default="", help="[daemon] name: the stream is shared")
    p.add_argument("--tables", default="", help="the folder of the streams' tables on disk")
    p.add_argument("--pause-before", type=int, default=0, help="wait for a stdin line first")
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
