"""Child process of the lock tests: holds a WAL open until it is killed.

``python -m tests.wal.lock_holder DIR`` opens the WAL in DIR (naming a data_dir
and config in its lock file), prints ``ready`` and sleeps.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import structlog

from wal import Wal

if __name__ == "__main__":
    # stdout carries "ready"; the WAL's log lines go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    directory = Path(sys.argv[1])
    wal = Wal.open(directory, holder={"data_dir": str(directory.parent), "config": "/etc/ep.toml"})
    print("ready", flush=True)
    time.sleep(600)
