"""``eventplane cdc show STREAM [--limit N]``: the latest committed rows of a CDC stream.
``eventplane cdc compact STREAM [--dry-run]``: merge its small files now (``compact``).

Reads only what a plain reader would see (published files), newest batches
first, using the stream's ledger to open just enough files for ``--limit``
rows. Spark runs embedded (``local[1]``) whatever ``[spark]`` says: the stream
path is a local folder, and a look at a table should not submit a job to a
cluster. Works while the daemon runs (it only reads).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from daemon.config import CdcStream, Config
from daemon.spark.cdc import committed_files, read_ledger

COLUMNS = ("lsn", "batch_id", "core", "collection", "op", "key", "new", "old", "ingest_ts")
MAX_CELL = 60  # characters per cell before "..."; JSON documents can be long


def newest_files(stream: CdcStream, limit: int) -> list[Path]:
    """Files of the newest committed batches holding at least ``limit`` rows."""
    ledger = read_ledger(stream.path)
    last = ledger.last_batch_id if ledger is not None else 0
    files = [(b, f) for b, f in committed_files(stream.path) if b <= last]
    rows = {e.batch_id: e.rows for e in ledger.batches} if ledger is not None else {}
    chosen: list[Path] = []
    taken = 0
    current = None
    for batch_id, f in files:
        if batch_id != current:
            if taken >= limit:
                break
            current = batch_id
            # A batch older than the ledger's window: rows unknown, take it and go on.
            taken += rows.get(batch_id, 0) or limit
        chosen.append(f)
    return chosen


def latest_rows(spark: Any, stream: CdcStream, limit: int) -> list[dict[str, Any]]:
    files = newest_files(stream, limit)
    if not files:
        return []
    df = spark.read.option("basePath", str(stream.path)).parquet(*map(str, files))
    out = (
        df.selectExpr(
            "lsn",
            "batch_id",
            "core",
            "collection",
            "op",
            "key",
            "to_json(new) AS new",
            "to_json(old) AS old",
            "date_format(ingest_ts, \"yyyy-MM-dd'T'HH:mm:ss.SSSSSS'Z'\") AS ingest_ts",
        )
        .orderBy("lsn", ascending=False)
        .limit(limit)
        .collect()
    )
    return [r.asDict() for r in out]


def format_rows(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        s = "null" if v is None else str(v)
        return s if len(s) <= MAX_CELL else s[: MAX_CELL - 3] + "..."

    table = [list(COLUMNS)] + [[cell(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(
    args: argparse.Namespace, cfg: Config, *, session: Any = None, out: TextIO | None = None
) -> int:
    """Print the latest rows; 1 when the stream is unknown. ``session``: reuse (tests)."""
    out = out or sys.stdout
    if args.cdc_command == "compact":
        from daemon.cli import compact

        return compact.main(args, cfg, session=session, out=out)
    if args.cdc_command != "show":
        print(f"eventplane cdc: unknown action {args.cdc_command!r}", file=sys.stderr)
        return 2
    if args.limit < 1:
        print("eventplane cdc show: --limit must be >= 1", file=sys.stderr)
        return 2
    stream = next((s for s in cfg.cdc.streams if s.name == args.stream), None)
    if stream is None:
        known = ", ".join(s.name for s in cfg.cdc.streams) or "none configured"
        print(
            f"eventplane cdc show: no stream named {args.stream!r} (streams: {known})",
            file=sys.stderr,
        )
        return 1
    if not newest_files(stream, 1):
        print(f"stream {stream.name!r} ({stream.path}): no committed rows yet", file=out)
        return 0
    owned = session is None
    if owned:
        from daemon.spark.session import build_session

        session = build_session("local[1]", "eventplane-cdc-show", False, "ERROR", {})
    try:
        rows = latest_rows(session, stream, args.limit)
    finally:
        if owned:
            session.stop()
    ledger = read_ledger(stream.path)
    last = ledger.last_batch_id if ledger else 0
    print(
        f"stream {stream.name!r} ({stream.path}): last committed batch {last}, "
        f"latest {len(rows)} rows, newest first",
        file=out,
    )
    print(format_rows(rows), file=out)
    return 0
