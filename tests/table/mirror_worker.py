"""A mirror's writer in a process of its own, for tests/table/test_mirror_s3.py.

``python -m tests.table.mirror_worker STATE_DIR --s3 JSON --batches N`` opens
the mirror ``orders`` whose table is at ``{"uri": ..., "s3": {the [s3]
section}}`` and merges batches 1..N of :func:`batches`, printing
``committed <n>`` after each; an error is printed (``failed: ...``) and the
exit status is 1. Crash and pause points (``EVENTPLANE_PAUSE_AT``) apply.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from daemon.config import CdcMirror, S3Config
from daemon.plane.batch import MicroBatch
from daemon.table.mirror import MirrorTable
from tests.table.test_mirror import COLUMNS, CORES, commit, make_batch

WAL_ID = "w1"


def batches(n: int) -> list[MicroBatch]:
    """Batches 1..n, the same in every process: 12 events each over 8 keys,
    inserts, updates and deletes, so each batch changes keys an earlier one wrote."""
    out = []
    for b in range(1, n + 1):
        evs = []
        for j in range(12):
            lsn = b * 100 + j
            key = f"k{(b * 5 + j) % 8}"
            op = ("insert", "update", "update", "delete")[(b + j) % 4]
            evs.append((lsn, "orders", op, key, None if op == "delete" else {"amount": lsn}))
        out.append(make_batch(b, evs))
    return out


def mirror_on_s3(state: Path, uri: str, cfg: S3Config) -> CdcMirror:
    return CdcMirror("orders", "orders", state, COLUMNS, buckets=4, uri=uri, s3=cfg)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("state", type=Path)
    p.add_argument("--s3", required=True, help='{"uri": ..., "s3": {...}}')
    p.add_argument("--batches", type=int, required=True)
    args = p.parse_args()
    raw = json.loads(args.s3)
    m = MirrorTable(
        mirror_on_s3(args.state, raw["uri"], S3Config(**raw["s3"])), wal_id=WAL_ID, cores=CORES
    )
    try:
        m.open()
        for batch in batches(args.batches):
            commit(m, batch)
            print(f"committed {batch.batch_id}", flush=True)
    except Exception as exc:
        print(f"failed: {type(exc).__name__}: {exc}", flush=True)
        return 1
    finally:
        m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
