"""Warm a new SparkSession up before the first real batch runs on it.

A new driver JVM runs its first batches interpreted: every class of the write
path is loaded then, Spark generates and compiles its code for the plan, and
the JIT compilers start on the per-row loops only once they are hot. A new
daemon's first CDC batch took 4-17 s under load that way (its later ones
0.5-2 s), with the backlog of the whole start-up behind it
(docs/performance.md, "The daemon's JVM").

``warm_session`` runs the batch path once, on ``rows`` synthetic events, into
a scratch CDC table under ``<data_dir>/spark-warmup`` that is removed again:

1. The scratch folder of an earlier warm-up (a crash in the middle) is
   removed, and made anew.
2. A synthetic batch (two collections, inserts and updates, JSON payloads of
   the usual size; the daemon's cores) goes through the steps of a real one:
   the batch file (``frame.batch_frame``, into a scratch inbox when the
   daemon uses one) and one ``CdcSink.commit`` into a scratch stream with the
   first configured stream's table layout (its partition columns). It runs
   the commit as a Spark job, which the triggers' and handlers' jobs share;
   a real batch's CDC write mostly runs without one (``DirectWrite``,
   docs/cdc.md), with the same reader and Parquet writer, which this loads
   and compiles too.
3. The scratch folder is removed.

Nothing of it reaches the WAL, the plan log, a real table or its ledger; no
trigger and no ``[[cdc.handlers]]`` function runs (their effects are the
user's). A warm-up that fails is logged and ignored: the first real batch is
then merely slow (``SparkExecutor._build``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from daemon.config import CdcStream, Config
from daemon.events import StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from daemon.spark import frame
from daemon.table.parquet import CdcSink
from wal.record import Record

# The scratch folder under ``daemon.data_dir``.
WARMUP_DIR = "spark-warmup"
# Keys per collection: most events are updates of an earlier key, as in the
# benchmarks' traffic (bench_cdc).
_KEYS = 1000
_COLLECTIONS = ("warmup_a", "warmup_b")


def synthetic_batch(rows: int, cores: int) -> MicroBatch:
    """``rows`` events over ``cores`` cores (round robin), LSNs from 1, batch id 1."""
    now = time.time_ns()
    per_core: dict[int, list[Record]] = {}
    for lsn in range(1, rows + 1):
        n = lsn // len(_COLLECTIONS)
        new = {"id": n % _KEYS, "amount": n * 7 % 10_000, "status": "paid", "note": "w" * 40}
        new["tags"] = ["a", "b"]
        new["address"] = {"city": "Zurich", "zip": str(8000 + n % 100)}
        update = lsn > 2 * _KEYS
        event = StoredEvent(
            _COLLECTIONS[lsn % len(_COLLECTIONS)],
            "update" if update else "insert",
            f"k{n % _KEYS}",
            json.dumps(new).encode(),
            json.dumps({"amount": n % 100}).encode() if update else None,
            now,
        )
        core = lsn % cores
        records = per_core.setdefault(core, [])
        records.append(Record(lsn, core, len(records) + 1, encode(event)))
    slices = {c: Slice(c, recs[0].lsn, recs[-1].lsn, recs) for c, recs in per_core.items()}
    return MicroBatch(1, dict(sorted(slices.items())))


def scratch_stream(cfg: Config, folder: Path) -> CdcStream:
    """The scratch table's stream: the first configured stream's layout, every
    collection, no compaction or retention."""
    streams = cfg.cdc.streams
    base = streams[0] if streams else CdcStream("warmup", ("*",), folder)
    return dataclasses.replace(
        base,
        name="warmup",
        collections=("*",),
        path=folder / "cdc",
        start="head",
        retention_s=None,
        compaction=False,
    )


def warm_session(
    spark: Any, cfg: Config, rows: int, parallelism: int, use_inbox: bool
) -> dict[str, Any]:
    """Run the batch path once on ``rows`` synthetic events (module docstring).
    Blocking (py4j); the executor's worker thread calls it. Returns what it
    did, for the log."""
    started = time.monotonic()
    folder = cfg.data_dir / WARMUP_DIR
    # Step 1. A fresh scratch folder.
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        # Step 2. The batch path, as the executor runs it for one CDC stream.
        batch = synthetic_batch(rows, max(1, cfg.daemon.cores))
        inbox = folder / "inbox" if use_inbox else None
        if inbox is not None:
            inbox.mkdir()
        sink = CdcSink(scratch_stream(cfg, folder), wal_id="warmup", cores=cfg.daemon.cores)
        sink.open()
        try:
            df, _counts = frame.batch_frame(
                spark, batch, inbox, parallelism, cfg.microbatch.build_max_bytes
            )
            sink.commit(df, batch, rows)
        finally:
            sink.close()
    finally:
        # Step 3. Nothing of it stays.
        shutil.rmtree(folder, ignore_errors=True)
    return {"rows": rows, "seconds": round(time.monotonic() - started, 3)}
