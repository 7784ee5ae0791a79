"""Child process of the CDC lock test: holds a stream open until it is killed.

``python -m tests.spark.cdc_lock_holder PATH DATA_DIR`` opens a CdcSink on PATH
(no Spark: opening a stream only locks it and reads its ledger), prints
``ready`` and sleeps.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import structlog

from daemon.config import CdcStream
from daemon.table.parquet import CdcSink

if __name__ == "__main__":
    # stdout carries "ready"; log lines go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    stream = CdcStream("all", ("*",), Path(sys.argv[1]), format="parquet")
    sink = CdcSink(stream, wal_id="wal-a", cores=2, data_dir=Path(sys.argv[2]))
    sink.open()
    print("ready", flush=True)
    time.sleep(600)
