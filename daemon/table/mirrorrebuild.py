"""``eventplane cdc mirror rebuild NAME``: a mirror folded anew from its change
log into a new table, then switched to at once (docs/cdc.md, "Mirror tables").

The way to change a mirror's ``buckets``, ``columns`` or ``history``, or to
repair one that verify (:mod:`daemon.table.mirrorverify`) found wrong. The
mirror on local disk, the daemon stopped (the mirror's lock), steps:

1. **Lock and clean.** Take the mirror's lock (a daemon that writes it
   refuses the rebuild); remove what an earlier rebuild left
   (``<path>.rebuild``: it starts over).
2. **Fold.** A new mirror table at ``<path>.rebuild`` as the config says it
   (the daemon's WAL id and cores), fed the log (a Delta CDC stream that
   takes the collection, up to its last batch ``S``, at least the old
   mirror's) a chunk of batches at a time: one merge per chunk, its ``txn``
   the chunk's last batch id (so the last is ``S``), a progress bar.
3. **Switch.** ``renameat2(RENAME_EXCHANGE)`` swaps the two folders in one
   step: a reader opens the old table or the new one, never neither.
4. **Remove** the old table (now at ``<path>.rebuild``).

A kill before step 3 leaves the old mirror in place and serving; the next
rebuild starts over at step 1. A kill after it leaves the new one in place.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from daemon.config import CdcMirror, CdcStream, Config
from daemon.plane.batch import MicroBatch
from daemon.table.crash import crash_point
from daemon.table.delta import app_id as stream_app_id
from daemon.table.durable import fsync_dir
from daemon.table.layout import META_DIR
from daemon.table.mirror import MirrorTable, app_id
from daemon.table.mirrorverify import (
    LOG_COLUMNS,
    VerifyError,
    check_holds,
    first_batch,
    log_stream,
)
from wal import lockfile

# Rows of the log one merge of a rebuild takes (batches are not split): a
# few hundred MB of Arrow at most, and few merges for a long log.
CHUNK_ROWS = 200_000
# renameat2(2): swap the two paths (Linux 3.15+, glibc 2.28+).
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class RebuildError(VerifyError):
    """A rebuild that cannot run; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Rebuilt:
    mirror: str
    stream: str
    last_batch: int
    events: int  # the log's events of the collection folded
    rows: int  # the new table's rows
    seconds: float


def exchange(a: Path, b: Path) -> None:
    """Swap the folders ``a`` and ``b`` in one step (renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    swap = getattr(libc, "renameat2", None)
    if swap is None:
        raise RebuildError("this system's C library has no renameat2: the switch cannot be atomic")
    if swap(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        errno = ctypes.get_errno()
        raise RebuildError(
            f"swapping {a} and {b} failed: {os.strerror(errno)} (the file system must support "
            f"renameat2 RENAME_EXCHANGE); the old mirror is in place"
        )


def _wal_id(mirror: CdcMirror, stream: CdcStream) -> str:
    """The daemon's WAL id: the old mirror's, else the stream's table's."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    for where, options in ((mirror.location, None), (stream.location, _options(stream))):
        try:
            props = dict(DeltaTable(where, storage_options=options).metadata().configuration)
        except TableNotFoundError:
            continue
        if props.get("eventplane.wal_id"):
            return props["eventplane.wal_id"]
    raise RebuildError(
        f"mirror {mirror.name!r}: neither it nor stream {stream.name!r} names the daemon's WAL "
        f"(no table yet): start the daemon once first"
    )


def _chunks(counts: dict[int, int], last: int) -> list[tuple[int, int]]:
    """Batch ranges ``(lo, hi)`` of about ``CHUNK_ROWS`` rows each, covering
    ``1..last`` (the last one ends at ``last``)."""
    out: list[tuple[int, int]] = []
    lo, rows = 1, 0
    for bid in sorted(counts):
        rows += counts[bid]
        if rows >= CHUNK_ROWS:
            out.append((lo, bid))
            lo, rows = bid + 1, 0
    if lo <= last:
        out.append((lo, last))
    return out


def rebuild(
    cfg: Config, mirror: CdcMirror, *, progress: Callable[[int, int], None] | None = None
) -> Rebuilt:
    """Steps 1-4 (module docstring); ``progress(done, total)`` in batches."""
    import pyarrow.compute as pc
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    started = time.monotonic()
    if mirror.uri:
        raise RebuildError(
            f"mirror {mirror.name!r} is on S3 ({mirror.uri}): a rebuild swaps two local folders; "
            f"rebuild into a new prefix by pointing path at it (the daemon folds from the head)"
        )
    stream = log_stream(cfg, mirror)
    path = Path(mirror.path)
    fresh = Path(f"{path}.rebuild")
    # Step 1. Lock and clean.
    (path / META_DIR).mkdir(parents=True, exist_ok=True)
    try:
        lock = lockfile.take(path / META_DIR / "lock", {"mirror": mirror.name, "rebuild": "true"})
    except lockfile.LockHeld as exc:
        raise RebuildError(
            f"mirror {mirror.name!r}: {path} is locked by another process ({exc}): stop the "
            f"daemon that writes it first"
        ) from None
    try:
        shutil.rmtree(fresh, ignore_errors=True)
        wal_id = _wal_id(mirror, stream)
        try:
            before = DeltaTable(str(path))
            old, first = before.transaction_version(app_id(wal_id, mirror.name)), 1
            if old is not None:
                first = first_batch(before)
        except TableNotFoundError:
            old, first = None, 1
        log = DeltaTable(stream.location, storage_options=_options(stream))
        last = int(log.transaction_version(stream_app_id(wal_id, stream.name)) or 0)
        if old is not None and last < int(old):
            raise RebuildError(
                f"stream {stream.name!r} holds batches up to {last}, the mirror up to {old}: the "
                f"log is behind the mirror (is the stream paused?); rebuild once it caught up"
            )
        # Step 2. Fold into the new table.
        dataset = log.to_pyarrow_dataset()
        if old is not None:  # the log must hold what the old mirror holds
            check_holds(stream, dataset, first)
        mine = pc.field("collection") == mirror.collection
        ids = dataset.to_table(columns=["batch_id"], filter=mine & (pc.field("batch_id") <= last))
        counts = {
            int(v["values"]): int(v["counts"]) for v in pc.value_counts(ids["batch_id"]).to_pylist()
        }
        table = MirrorTable(
            dataclasses.replace(mirror, path=fresh), wal_id=wal_id, cores=cfg.daemon.cores
        )
        table.open()
        events = 0
        try:
            chunks = _chunks(counts, last)
            for lo, hi in chunks:
                rows = dataset.to_table(
                    columns=list(LOG_COLUMNS),
                    filter=mine & (pc.field("batch_id") >= lo) & (pc.field("batch_id") <= hi),
                )
                events += rows.num_rows
                table.commit(rows, MicroBatch(hi, {}), note={"first_batch": lo, "rebuild": True})
                crash_point("mirror.rebuild.mid_fold")
                if progress is not None:
                    progress(hi, last)
        finally:
            table.close()
        fsync_dir(fresh)
        crash_point("mirror.rebuild.before_switch")
        # Step 3. Switch.
        exchange(path, fresh)
        fsync_dir(path.parent)
        crash_point("mirror.rebuild.after_switch")
        # Step 4. The old table, now at <path>.rebuild.
        shutil.rmtree(fresh, ignore_errors=True)
    finally:
        os.close(lock)
    rows_now = DeltaTable(str(path)).to_pyarrow_dataset().count_rows()
    return Rebuilt(mirror.name, stream.name, last, events, rows_now, time.monotonic() - started)


def _options(stream: CdcStream) -> dict[str, str] | None:
    if not stream.uri:
        return None
    from daemon.config import S3Config
    from daemon.table.s3 import storage_options

    return storage_options(stream.s3 or S3Config())
