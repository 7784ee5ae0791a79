"""A history mirror's writer in a process of its own, for
tests/table/test_mirror_history.py.

``python -m tests.table.history_worker PATH --batches N`` opens the history
mirror ``orders`` at PATH (local disk) and merges batches 1..N of
:func:`batches` (a re-run starts at 1: the table's txn skips what it holds),
printing ``committed <n>`` after each. Crash points (``EVENTPLANE_CRASH_AT``)
apply.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

from daemon.config import CdcMirror
from daemon.plane.batch import MicroBatch
from daemon.table.mirror import MirrorTable
from tests.table.test_mirror import COLUMNS, CORES, commit, make_batch

WAL_ID = "w1"
KEYS = 12


def events(n: int) -> list[list[tuple[int, str, str, str, Any]]]:
    """The events of batches 1..n, the same in every process: 30 each over 12
    keys (so a key changes several times in a batch), inserts, updates and
    deletes, re-inserts, and events of another collection."""
    rng = random.Random(45)
    out = []
    lsn = 0
    for _ in range(n):
        evs = []
        for _ in range(30):
            lsn += 1
            op = rng.choice(["insert", "update", "update", "delete"])
            collection = rng.choice(["orders", "orders", "orders", "other"])
            key = f"k{rng.randrange(KEYS)}"
            evs.append((lsn, collection, op, key, None if op == "delete" else {"amount": lsn}))
        out.append(evs)
    return out


def batches(n: int) -> list[MicroBatch]:
    return [make_batch(b, evs) for b, evs in enumerate(events(n), 1)]


def history_mirror(path: Path, **kw: Any) -> CdcMirror:
    return CdcMirror("orders", "orders", path, COLUMNS, buckets=4, history=True, **kw)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("path", type=Path)
    p.add_argument("--batches", type=int, required=True)
    args = p.parse_args()
    m = MirrorTable(history_mirror(args.path), wal_id=WAL_ID, cores=CORES)
    m.open()
    try:
        for batch in batches(args.batches):
            commit(m, batch)
            print(f"committed {batch.batch_id}", flush=True)
    finally:
        m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
