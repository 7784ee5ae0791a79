"""A mirror's quarantine replay in a process of its own, for
tests/table/test_mirror_quarantine.py.

``python -m tests.table.mirror_quarantine_worker PATH [--history]`` opens the
mirror ``orders`` at PATH, no longer strict, and replays its whole quarantine,
printing the result as JSON. Crash points (``EVENTPLANE_CRASH_AT``) apply.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from daemon.config import CdcMirror
from daemon.table.mirror import MirrorTable
from tests.table.test_mirror import COLUMNS, CORES

WAL_ID = "w1"


def mirror_config(path: Path, *, strict: bool, history: bool) -> CdcMirror:
    return CdcMirror("orders", "orders", path, COLUMNS, buckets=4, strict=strict, history=history)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("path", type=Path)
    p.add_argument("--history", action="store_true")
    args = p.parse_args()
    m = MirrorTable(
        mirror_config(args.path, strict=False, history=args.history), wal_id=WAL_ID, cores=CORES
    )
    m.open()
    try:
        print(json.dumps(m.replay_quarantine()), flush=True)
    finally:
        m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
