"""``eventplane cdc show STREAM [--limit N]``: the latest committed rows of a CDC stream;
``eventplane cdc rewrite STREAM``: its files of the previous payload layout, rewritten;
``eventplane cdc retention STREAM [--apply]``: the stream's expired time partitions
(docs/cdc.md, "Time partitioning and retention"), removed with ``--apply``.
``eventplane cdc compact STREAM [--dry-run]``: merge its small files now (``compact``).
``eventplane cdc files STREAM [--json]``: a consistent list of its data files
(:mod:`daemon.snapshot`), for readers that must not race a compaction's swap.
``eventplane cdc lease STREAM [--break [--yes]]``: the writer's lease of a
table on S3 (``daemon.table.lease``), broken by hand with ``--break``.
``eventplane cdc mirror verify NAME``: a mirror compared with a fold of its
change log (:mod:`daemon.table.mirrorverify`), exit 1 when they differ;
``eventplane cdc mirror rebuild NAME``: folded anew and switched to
(:mod:`daemon.table.mirrorrebuild`); ``eventplane cdc mirror quarantine
list|replay|purge NAME``: a strict mirror's set-aside events
(:mod:`daemon.cli.quarantine`).

``show`` reads only what a plain reader would see (published files), newest
batches first, using the stream's ledger to open just enough files for
``--limit`` rows. A Delta table is read by delta-rs, with no JVM; a Parquet
folder (or a ``variant = true`` Delta table) by Spark, embedded (``local[1]``)
whatever ``[spark]`` says: a look at a table should not submit a job to a
cluster. Works while the daemon runs (it only reads). The
producer's ``event_id`` and ``event_time`` are shown when one of the rows has
them.

``rewrite`` (:mod:`daemon.table.rewrite`) takes the stream's lock, so it is
refused while the daemon runs; embedded Spark (``local[*]``) too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from daemon.config import CdcStream, Config, S3Config
from daemon.table.delta import table_exists as delta_table_exists
from daemon.table.errors import CdcStreamLockedError
from daemon.table.layout import committed_files
from daemon.table.ledger import read_ledger
from daemon.table.parquet import CdcSink

COLUMNS = ("lsn", "batch_id", "core", "collection", "op", "key", "new", "old", "ingest_ts")
# Shown after "key" when a row has a value (files from before them have no such column).
PRODUCER_COLUMNS = ("event_id", "event_time", "producer")
_TIMESTAMP = "date_format({0}, \"yyyy-MM-dd'T'HH:mm:ss.SSSSSS'Z'\") AS {0}"
MAX_CELL = 60  # characters per cell before "..."; JSON documents can be long


# What the Parquet-only verbs answer for a Delta stream.
DELTA_ANSWERS = {
    "files": "its files are those its log lists: deltalake.DeltaTable('{path}').file_uris()",
    "rewrite": "a Delta table has one layout; there is nothing to rewrite",
}


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
    """The newest ``limit`` rows, listed and read within one table generation:
    a compaction or retention run meanwhile makes the whole query run again
    (docs/cdc.md, "Reading while compaction runs")."""
    from daemon.table.snapshot import consistent

    if stream.format == "delta":  # a Delta read is a snapshot already
        df = spark.read.format("delta").load(str(stream.path))
        return _project(df, limit, payloads="json")
    return consistent(stream.path, lambda: _newest_rows(spark, stream, limit))


def latest_rows_delta(stream: CdcStream, limit: int) -> list[dict[str, Any]]:
    """``latest_rows`` of a Delta table without VARIANT columns (on disk or
    on S3), by delta-rs, no JVM: the rows of the newest batches the stream's
    ledger names, widened until ``limit`` are found."""
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    from daemon.table.location import table_files

    files = table_files(stream)
    ledger = read_ledger(stream.path)
    if ledger is None or ledger.last_batch_id == 0:
        return []
    dataset = DeltaTable(files.uri, storage_options=files.storage_options).to_pyarrow_dataset()
    wanted = [
        c for c in ("lsn", "batch_id", "core", "collection", "op", "key", *PRODUCER_COLUMNS,
                    "new_json", "old_json", "ingest_ts") if c in dataset.schema.names
    ]  # fmt: skip
    back = 1
    while True:
        since = max(0, ledger.last_batch_id - back)
        table = dataset.to_table(columns=wanted, filter=pc.field("batch_id") > since)
        if table.num_rows >= limit or since == 0:
            break
        back *= 4
    table = table.sort_by([("lsn", "descending")]).slice(0, limit)
    names = [{"new_json": "new", "old_json": "old"}.get(c, c) for c in table.column_names]
    rows: list[dict[str, Any]] = table.rename_columns(names).to_pylist()
    for row in rows:
        for col in ("ingest_ts", "event_time"):
            if row.get(col) is not None:
                row[col] = row[col].strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return rows


def lease(stream: CdcStream, *, break_it: bool, yes: bool, out: TextIO, name: str = "") -> int:
    """Show the writer's lease of a table on S3, or remove it (``--break``)
    after a confirmation: for a daemon that is gone for good, when waiting
    for the lease to expire is not wanted (docs/cdc.md, "Tables on S3"). A
    shared table's lease is the one of ``name`` (``[daemon] name``)."""
    import json as jsonmod
    import time

    from daemon.table.layout import META_DIR
    from daemon.table.lease import S3Store, break_lease
    from daemon.table.location import S3Files

    if not stream.uri:
        print(f"stream {stream.name!r} ({stream.path}): a table on local disk has no lease "
              "(its lock file is released when the daemon exits)", file=out)  # fmt: skip
        return 1
    files = S3Files(stream.uri, stream.s3 or S3Config())
    store = S3Store(files.client, files.where.bucket)
    under = f"{META_DIR}/writers/{name}" if stream.writers == "shared" else META_DIR
    key = files.where.key(f"{under}/lease.json")
    current = store.get(key)
    if current is None:
        print(f"stream {stream.name!r} ({stream.uri}): no lease: no daemon writes it", file=out)
        return 0
    raw = jsonmod.loads(current[0])
    holder = ", ".join(f"{k} {v}" for k, v in raw["holder"].items())
    left = float(raw["expires_at"]) - time.time()
    state = f"expires in {left:.0f} s" if left > 0 else f"expired {-left:.0f} s ago"
    print(f"stream {stream.name!r} ({stream.uri}): lease held by {holder}; {state}", file=out)
    if not break_it:
        return 0
    if not yes:
        answer = input(
            "Break it? Only when that daemon is gone for good: a daemon still running "
            "takes the lease again at its next renewal, and two daemons writing one table "
            "is what the lease prevents. Type 'break' to go on: "
        )
        if answer.strip() != "break":
            print("not broken", file=out)
            return 1
    break_lease(store, key)
    print(f"stream {stream.name!r}: lease broken; the next daemon to open it takes it", file=out)
    return 0


def _newest_rows(spark: Any, stream: CdcStream, limit: int) -> list[dict[str, Any]]:
    files = newest_files(stream, limit)
    if not files:
        return []
    # mergeSchema: the chosen files may mix tables' older files (without
    # event_id/event_time) and newer ones; a plain read takes one file's schema.
    df = (
        spark.read.option("basePath", str(stream.path))
        .option("mergeSchema", "true")
        .parquet(*map(str, files))
    )
    return _project(df, limit, payloads="variant")


def _project(df: Any, limit: int, *, payloads: str) -> list[dict[str, Any]]:
    """The newest ``limit`` rows of ``df`` as ``show`` prints them; the
    payloads from the VARIANT columns or the JSON text (a Delta table)."""
    new, old = (
        ("to_json(new) AS new", "to_json(old) AS old")
        if payloads == "variant"
        else ("new_json AS new", "old_json AS old")
    )
    producer = [
        _TIMESTAMP.format(c) if c == "event_time" else c
        for c in PRODUCER_COLUMNS
        if c in df.columns
    ]
    out = (
        df.selectExpr(
            "lsn",
            "batch_id",
            "core",
            "collection",
            "op",
            "key",
            *producer,
            new,
            old,
            _TIMESTAMP.format("ingest_ts"),
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

    shown = [c for c in PRODUCER_COLUMNS if any(r.get(c) is not None for r in rows)]
    at = COLUMNS.index("key") + 1
    columns = [*COLUMNS[:at], *shown, *COLUMNS[at:]]
    table = [columns] + [[cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
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
    if args.cdc_command == "retention":
        return retention_main(args, cfg, out)
    if args.cdc_command == "compact":
        from daemon.cli import access, compact

        admin = access.from_args(args, access.ENV_ADMIN_TOKEN_FILE)
        return compact.main(args, cfg, session=session, out=out, access=admin)
    if args.cdc_command == "mirror":
        return mirror_main(args, cfg, out)
    if args.cdc_command == "quarantine":
        from daemon.cli import quarantine

        return quarantine.main(args, cfg, out, session=session)
    if args.cdc_command not in ("show", "rewrite", "files", "lease"):
        print(f"eventplane cdc: unknown action {args.cdc_command!r}", file=sys.stderr)
        return 2
    if args.cdc_command == "show" and args.limit < 1:
        print("eventplane cdc show: --limit must be >= 1", file=sys.stderr)
        return 2
    stream = next((s for s in cfg.cdc.streams if s.name == args.stream), None)
    if stream is None:
        known = ", ".join(s.name for s in cfg.cdc.streams) or "none configured"
        print(
            f"eventplane cdc {args.cdc_command}: no stream named {args.stream!r} "
            f"(streams: {known})",
            file=sys.stderr,
        )
        return 1
    if stream.format == "delta" and args.cdc_command in DELTA_ANSWERS:
        print(
            f"eventplane cdc {args.cdc_command}: stream {stream.name!r} is a Delta table: "
            f"{DELTA_ANSWERS[args.cdc_command].format(path=stream.location)}",
            file=sys.stderr,
        )
        return 1
    if args.cdc_command == "lease":
        return lease(stream, break_it=args.break_lease, yes=args.yes, out=out, name=cfg.daemon.name)
    if args.cdc_command == "rewrite":
        return rewrite(stream, session=session, out=out)
    if args.cdc_command == "files":
        return files(stream, as_json=args.json, out=out)
    delta = stream.format == "delta"
    if delta and not stream.variant:  # delta-rs reads it, on disk or on S3: no JVM
        rows = latest_rows_delta(stream, args.limit)
    elif not (delta_table_exists(stream.path) if delta else newest_files(stream, 1)):
        rows = []
    else:
        rows = _rows_by_spark(stream, args.limit, session)
    if not rows:
        print(f"stream {stream.name!r} ({stream.location}): no committed rows yet", file=out)
        return 0
    ledger = read_ledger(stream.path)
    last = ledger.last_batch_id if ledger else 0
    print(
        f"stream {stream.name!r} ({stream.location}): last committed batch {last}, "
        f"latest {len(rows)} rows, newest first",
        file=out,
    )
    print(format_rows(rows), file=out)
    return 0


def _rows_by_spark(stream: CdcStream, limit: int, session: Any) -> list[dict[str, Any]]:
    """``latest_rows`` in an embedded Spark (``session``, else one of its own):
    a Parquet folder, or a ``variant = true`` Delta table (Delta's jars)."""
    owned = session is None
    if owned:
        from daemon.spark.session import build_session

        delta = stream.format == "delta"
        session = build_session(
            "local[1]", "eventplane-cdc-show", False, "ERROR", {}, delta=delta, quiet=True
        )
    try:
        return latest_rows(session, stream, limit)
    finally:
        if owned:
            session.stop()


def files(stream: CdcStream, *, as_json: bool, out: TextIO) -> int:
    """Print a snapshot of the stream's data files; 1 when it cannot be taken."""
    from daemon.table.snapshot import SnapshotError, snapshot

    try:
        snap = snapshot(stream.path)
    except (SnapshotError, FileNotFoundError) as exc:
        print(f"eventplane cdc files: stream {stream.name!r}: {exc}", file=sys.stderr)
        return 1
    if as_json:
        doc = {"stream": stream.name, "root": snap.root, "generation": snap.generation}
        print(json.dumps({**doc, "files": snap.files}), file=out)
    else:
        for f in snap.files:
            print(f, file=out)
    return 0


def rewrite(stream: CdcStream, *, session: Any = None, out: TextIO) -> int:
    """Rewrite the stream's previous-layout files; 1 when the daemon holds the stream."""
    from daemon.table.rewrite import previous_layout_files, rewrite_previous_layout

    ledger = read_ledger(stream.path)
    if ledger is None:
        print(f"stream {stream.name!r} ({stream.path}): no committed rows yet", file=out)
        return 0
    sink = CdcSink(stream, wal_id=ledger.wal_id, cores=ledger.cores)
    try:
        sink.open()  # the lock, and any interrupted commit finished first
    except CdcStreamLockedError as exc:
        print(f"eventplane cdc rewrite: {exc}", file=sys.stderr)
        return 1
    owned = session is None
    try:
        if not previous_layout_files(stream.path, sink.last_batch_id):
            print(
                f"stream {stream.name!r} ({stream.path}): every file has the current layout",
                file=out,
            )
            return 0
        if owned:
            from daemon.spark.session import build_session

            session = build_session("local[*]", "eventplane-cdc-rewrite", False, "ERROR", {})
        result = rewrite_previous_layout(session, sink)
    finally:
        sink.close()
        if owned and session is not None:
            session.stop()
    print(
        f"stream {stream.name!r} ({stream.path}): rewrote {result.files} files "
        f"({result.rows} rows) into the current layout in {result.seconds:.1f} s",
        file=out,
    )
    return 0


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        x /= 1024
        if x < 1024 or unit == "GiB":
            break
    return f"{x:.1f} {unit}"


def _retention_through_daemon(
    args: argparse.Namespace, cfg: Config, stream: str, held: str, out: TextIO
) -> int:
    """The daemon holds the stream: ask it for one retention run (admin API)."""
    from daemon.cli import access
    from daemon.cli.compact import Unreachable, _call
    from daemon.cli.status import STATUS_PATH, admin_url

    base = admin_url(cfg, getattr(args, "url", None)).removesuffix(STATUS_PATH)
    url = f"{base}/v1/cdc/{stream}/retention"
    admin = access.from_args(args, access.ENV_ADMIN_TOKEN_FILE)
    try:
        status, doc = _call("POST", url, timeout=600.0, access=admin)
    except Unreachable as exc:
        print(
            f"eventplane cdc retention: stream {stream!r} is locked ({held}) and no daemon "
            f"answers at {url} ({exc})",
            file=sys.stderr,
        )
        return 1
    if status != 200:
        print(f"eventplane cdc retention: the daemon answered {status}: {doc}", file=sys.stderr)
        return 1
    print(
        f"removed {doc.get('partitions', 0)} partitions, {doc.get('files', 0)} files, "
        f"{_size(int(doc.get('bytes', 0)))}, {doc.get('rows', 0)} rows (by the daemon)",
        file=out,
    )
    return 0


def retention_main(args: argparse.Namespace, cfg: Config, out: TextIO) -> int:
    """Preview, or with ``--apply`` remove, the expired partitions of a stream.

    ``--apply`` takes the stream's lock (``_eventplane/lock``) for the run, so
    it refuses while the daemon writes the stream: the daemon applies
    retention itself every ``retention_check_s``.
    """
    from daemon.table import retention
    from wal import lockfile

    stream = next((s for s in cfg.cdc.streams if s.name == args.stream), None)
    if stream is None:
        known = ", ".join(s.name for s in cfg.cdc.streams) or "none configured"
        print(
            f"eventplane cdc retention: no stream named {args.stream!r} (streams: {known})",
            file=sys.stderr,
        )
        return 1
    if stream.retention_s is None:
        print(
            f"eventplane cdc retention: stream {stream.name!r} has no retention "
            f'(set retention = "30d" and partition_by = ["collection", "date"])',
            file=sys.stderr,
        )
        return 1
    if stream.format == "delta":
        # A Delta table's partitions are what its log says: the daemon's
        # Spark runs the DELETE and VACUUM (DeltaSink.apply_retention).
        if not args.apply:
            print(
                f"stream {stream.name!r} ({stream.path}): a Delta table; retention deletes "
                f"rows ingested more than {stream.retention_s // 3600} h ago (whole date "
                f"partitions), VACUUM removes their files {stream.vacuum_retain_hours:g} h "
                f"later; --apply asks the daemon to run it now",
                file=out,
            )
            return 0
        return _retention_through_daemon(
            args, cfg, stream.name, "Delta tables are maintained by the daemon", out
        )
    plan = retention.plan(stream)
    verb = "removing" if args.apply else "would remove"
    print(
        f"stream {stream.name!r} ({stream.path}): retention {stream.retention_s // 3600} h, "
        f"{verb} {len(plan.expired)} partitions; {len(plan.kept)} kept, "
        f"oldest kept {plan.oldest_kept or '-'}",
        file=out,
    )
    for part in plan.expired:
        rows = "?" if part.rows is None else str(part.rows)
        print(f"  {part.rel}  files {part.files}  {_size(part.bytes)}  rows {rows}", file=out)
    if not args.apply or not plan.expired:
        return 0
    meta = Path(stream.path) / "_eventplane"
    try:
        fd = lockfile.take(meta / "lock", {"stream": stream.name, "command": "cdc retention"})
    except lockfile.LockHeld as exc:
        return _retention_through_daemon(args, cfg, stream.name, str(exc), out)
    try:
        retention.recover(Path(stream.path), stream.name)
        result = retention.apply(stream)
    finally:
        import os

        os.close(fd)
    done = result.to_json()
    print(
        f"removed {done['partitions']} partitions, {done['files']} files, "
        f"{_size(done['bytes'])}, {done['rows']} rows",
        file=out,
    )
    return 0


def mirror_main(args: argparse.Namespace, cfg: Config, out: TextIO) -> int:
    """``cdc mirror verify``: 0 when the mirror is the fold of its log, 1 when
    it differs (the first differences printed), 2 when it cannot be compared.
    ``cdc mirror rebuild``: 0 once switched, 2 when it cannot run."""
    from daemon.table.mirrorverify import VerifyError, verify

    mirror = next((m for m in cfg.cdc.mirrors if m.name == args.mirror), None)
    if mirror is None:
        known = ", ".join(m.name for m in cfg.cdc.mirrors) or "none configured"
        print(
            f"eventplane cdc mirror: no mirror named {args.mirror!r} (mirrors: {known})",
            file=sys.stderr,
        )
        return 2
    if args.mirror_command == "rebuild":
        return _rebuild(cfg, mirror, out)
    if args.mirror_command == "quarantine":
        from daemon.cli import quarantine

        return quarantine.mirror_main(args, cfg, mirror, out)
    try:
        verdict = verify(cfg, mirror, limit=max(args.limit, 1))
    except VerifyError as exc:
        print(f"eventplane cdc mirror verify: {exc}", file=sys.stderr)
        return 2
    where = (
        f"mirror {verdict.mirror!r} and the fold of stream {verdict.stream!r}, "
        f"batches {verdict.first_batch}-{verdict.last_batch}"
    )
    if not verdict.differences:
        print(f"{where}: equal, {verdict.rows} rows compared", file=out)
        return 0
    print(f"{where}: differ (first {len(verdict.differences)} differences)", file=out)
    for d in verdict.differences:
        if d.column:
            what = f"column {d.column}: mirror {_cell(d.mirror)}, log {_cell(d.log)}"
        else:
            what = f"the row is {d.mirror} in the mirror, {d.log} in the log"
        print(f"  key {d.row}: {what}", file=out)
    return 1


def _cell(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 3] + "..."


def _rebuild(cfg: Config, mirror: Any, out: TextIO) -> int:
    from daemon.table.mirrorrebuild import rebuild
    from daemon.table.mirrorverify import VerifyError

    bar = _Bar(sys.stderr) if sys.stderr.isatty() else None
    try:
        done = rebuild(cfg, mirror, progress=bar)
    except VerifyError as exc:
        print(f"eventplane cdc mirror rebuild: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.end()
    print(
        f"mirror {done.mirror!r} rebuilt from stream {done.stream!r} up to batch "
        f"{done.last_batch}: {done.events} events folded, {done.rows} rows, "
        f"{done.seconds:.1f} s",
        file=out,
    )
    return 0


class _Bar:
    """A one-line progress bar on a terminal, in batches folded."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __call__(self, done: int, total: int) -> None:
        width, share = 30, done / max(total, 1)
        filled = int(width * share)
        self.stream.write(
            f"\rrebuild [{'#' * filled}{'.' * (width - filled)}] {100 * share:3.0f}% "
            f"batch {done} of {total}"
        )
        self.stream.flush()

    def end(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
