"""A stand-alone executor process for the quarantine's crash tests.

``python -m tests.spark.quarantine_worker ROOT [FORMAT]`` commits one batch of 12 rows
through a real ``SparkExecutor`` under ROOT while the writer refuses duplicate
keys, so rows 3, 6 and 9 (``{"a":1,"a":2}``) go to the quarantine; then it
lets the writer take them and replays them, printing ``committed 1`` and
``replayed <n>``. With ``EVENTPLANE_CRASH_AT`` set it SIGKILLs itself there.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from daemon.events import StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from tests.spark.support import make_config, say
from wal.record import Record

DUPLICATE_ROWS = (3, 6, 9)
ROWS = 12


def batch() -> MicroBatch:
    records = []
    for lsn in range(1, ROWS + 1):
        new = b'{"a":1,"a":2}' if lsn in DUPLICATE_ROWS else b'{"n":%d}' % lsn
        ev = StoredEvent("c", "insert", f"k{lsn}", new, None, 1_700_000_000 * 10**9)
        records.append(Record(lsn, 0, lsn, encode(ev)))
    return MicroBatch(1, {0: Slice(0, 1, ROWS, records)})


async def run(root: Path, table_format: str = "parquet") -> int:
    options = {"format": table_format}
    cfg = make_config(root, master="local[1]", stream_options=options)
    ex = SparkExecutor(cfg, Metrics(), wal_id="wal-1")
    await ex.start()
    try:
        await asyncio.wait_for(ex.wait_ready(), 240)
        spark = ex.session
        spark.conf.set("spark.sql.variant.allowDuplicateKeys", "false")
        await ex.execute(batch())
        say("committed 1")
        spark.conf.set("spark.sql.variant.allowDuplicateKeys", "true")
        result = await ex.quarantine_action("all", "replay", None)
        say(f"replayed {result['replayed']}")
    finally:
        await ex.stop()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(run(Path(sys.argv[1]), *sys.argv[2:3])))
