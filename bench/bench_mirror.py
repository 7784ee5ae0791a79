"""A mirror's merge per batch (docs/cdc.md, "Mirror tables"): p50/p99 seconds
of one batch of ``--changes`` changes (90 % updates, 5 % inserts, 5 % deletes)
into a mirror of ``--keys`` keys, keys uniform or hot (80 % of the changes to
5 % of the keys); the commit as the stage runs it (reduce, cast, delta-rs
MERGE with its txn, fsync), compaction every 50 commits included.

    python -m bench.bench_mirror --keys 100000 --batches 40
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from daemon import events
from daemon.config import CdcMirror
from daemon.plane.batch import MicroBatch, Slice
from daemon.spark import frame
from daemon.table.mirror import MirrorTable, arrow_schema, bucket_of
from wal.record import Record

COLUMNS = (("amount", "double"), ("status", "string"))


def _batch(batch_id: int, first_lsn: int, changes: list[tuple[str, str]]) -> MicroBatch:
    records = []
    for i, (op, key) in enumerate(changes):
        new = None if op == "delete" else json.dumps({"amount": i * 1.5, "status": op}).encode()
        ev = events.StoredEvent("orders", op, key, new, None, time.time_ns())  # type: ignore[arg-type]
        records.append(Record(first_lsn + i, 0, first_lsn + i, events.encode(ev)))
    return MicroBatch(batch_id, {0: Slice(0, first_lsn, first_lsn + len(records) - 1, records)})


def _preload(path: Path, mirror: CdcMirror, keys: int) -> None:
    """The table with ``keys`` keys, appended in bulk (a merge of each would
    take as long as the measurement), then compacted."""
    import pyarrow as pa
    from deltalake import write_deltalake

    table = MirrorTable(mirror, wal_id="bench", cores=1)
    table.open()
    table.commit(
        frame.batch_table(_batch(1, 1, [("insert", "k0")])), _batch(1, 1, [("insert", "k0")])
    )
    rows = [
        {
            "key": f"k{i}",
            "bucket": bucket_of(f"k{i}", mirror.buckets),
            "lsn": 1 + i,
            "op": "insert",
            "updated_at": None,
            "producer": None,
            "doc": json.dumps({"amount": i, "status": "insert"}),
            "amount": float(i),
            "status": "insert",
        }
        for i in range(1, keys)
    ]
    write_deltalake(
        str(path),
        pa.Table.from_pylist(rows, schema=arrow_schema(mirror)),
        mode="append",
        partition_by=["bucket"],
    )
    table.compact()
    table.close()


def run(keys: int, batches: int, changes: int, hot: bool, seed: int = 44) -> dict[str, Any]:
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="bench-mirror-"))
    try:
        mirror = CdcMirror("orders", "orders", root / "m", COLUMNS, buckets=16)
        _preload(root / "m", mirror, keys)
        table = MirrorTable(mirror, wal_id="bench", cores=1)
        table.open()
        hot_keys = max(1, keys // 20)
        lsn = keys + 1
        seconds = []
        for bid in range(2, batches + 2):
            picks = []
            for _ in range(changes):
                k = rng.randrange(hot_keys) if hot and rng.random() < 0.8 else rng.randrange(keys)
                r = rng.random()
                picks.append(("delete" if r < 0.05 else "insert" if r < 0.1 else "update", f"k{k}"))
            batch = _batch(bid, lsn, picks)
            lsn += changes
            started = time.monotonic()
            table.commit(frame.batch_table(batch), batch)
            seconds.append(time.monotonic() - started)
        table.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seconds.sort()
    return {
        "keys": keys,
        "keys_hot": hot,
        "batches": batches,
        "changes": changes,
        "p50_s": round(statistics.median(seconds), 3),
        "p99_s": round(seconds[min(len(seconds) - 1, int(len(seconds) * 0.99))], 3),
        "max_s": round(seconds[-1], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--keys", type=int, nargs="+", default=[100_000])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--changes", type=int, default=4000)
    args = ap.parse_args()
    print("| keys | changes to | batches | p50 s | p99 s | max s |")
    print("|---:|---|---:|---:|---:|---:|")
    for keys in args.keys:
        for hot in (False, True):
            r = run(keys, args.batches, args.changes, hot)
            where = "80 % to 5 % of keys" if hot else "uniform keys"
            print(
                f"| {keys:,} | {where} | {r['batches']} | {r['p50_s']} | {r['p99_s']} "
                f"| {r['max_s']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
