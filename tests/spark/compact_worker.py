"""A stand-alone executor process that commits batches and compacts, for crash tests.

``python -m tests.spark.compact_worker ROOT --batches N --per-batch M`` runs the
deterministic batches 1..N of ``tests.spark.support`` through a real
``SparkExecutor`` writing under ROOT, printing ``committed <id>`` after each
(from the first batch the table does not hold), then:

- ``--mode once``: compacts the stream in full (``compact_stream``), prints
  ``compacted <n>`` and exits (named crash points: ``EVENTPLANE_CRASH_AT``);
- ``--mode loop``: the background service compacts every 0.05 s whenever a
  size tier holds 3 files, while the batches commit; after the last batch it
  keeps compacting until it is killed (random-moment SIGKILL tests).

``--partition-by collection,date`` writes a time-partitioned stream (its
leaf folders ``collection=X/date=D`` are compacted).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from daemon.table.compact import compact_stream
from tests.spark.support import make_batches, make_config, say


async def run(args: argparse.Namespace) -> int:
    loop_mode = args.mode == "loop"
    options = (
        {"compact_min_files": 3, "compact_interval_s": 0.05} if loop_mode else {"compaction": False}
    )
    cfg = make_config(
        Path(args.root),
        master="local[2]",
        partition_by=tuple(args.partition_by.split(",")),
        stream_options=options,
    )
    ex = SparkExecutor(cfg, Metrics(), wal_id="wal-1")
    await ex.start()
    try:
        await asyncio.wait_for(ex.wait_ready(), 240)
        say("ready")
        done_before = ex.sinks[0].last_batch_id  # a restart goes on where it stopped
        for batch in make_batches(args.batches, args.per_batch):
            if batch.batch_id <= done_before:
                continue
            await ex.execute(batch)
            say(f"committed {batch.batch_id}")
        if loop_mode:
            await asyncio.Event().wait()  # the service keeps compacting; the test kills us
        (sink,) = ex.sinks
        done = await asyncio.to_thread(compact_stream, sink, ex.session, full=True)
        say(f"compacted {len(done)}")
    finally:
        await ex.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--per-batch", type=int, default=100)
    p.add_argument("--mode", choices=("once", "loop"), default="once")
    p.add_argument("--partition-by", default="collection")
    started = time.monotonic()
    code = asyncio.run(run(p.parse_args(argv)))
    say(f"exiting after {time.monotonic() - started:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
