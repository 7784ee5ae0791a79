"""``eventplane restore``: rebuild an empty data_dir from the WAL archive (docs/operating.md,
"Losing the machine").

1. Refuse a data_dir that holds a WAL (IDENTITY or a segment in ``wal/``).
2. Read the manifest (the archive's WAL id), list ``<uri>/wal/``, download every
   object in number order and check it whole (wal/archive.py: header CRC, body
   CRC, every frame's CRC, LSNs contiguous); fences mask an older epoch's
   objects after them, as at a start (daemon/walarchive.py). Frames are written
   byte for byte into segments of ``<data_dir>/.restore/wal`` (one per segment
   stamp the frames carry), IDENTITY last. A gap in the LSNs or a bad object
   stops it here: the temp dir goes, nothing else changed, the object named.
   ``--accept-loss-from L`` (L must be the first LSN that is not restorable)
   keeps what is before it; the objects from the bad one on are moved to
   ``<uri>/lost/`` so the archive agrees with the WAL, and the LSNs lost are
   named in the summary and the log.
3. Open the rebuilt WAL (a second full scan) and take the archive over, as
   ``run`` does (:meth:`WalArchive.open`: the next epoch, fences at the next
   names: an old holder still running is stopped at its next upload); release.
4. Read each Delta stream's and mirror's position on S3. If a table holds LSNs
   above the restored WAL's last (``ack = "local"``: the tables committed
   events the archive never got), a lost frame (wal/format.py, ``FLAG_LOST``)
   takes the WAL up to the highest: new events go on above every table's, the
   lost range is named (summary, log, ``eventplane_wal_lost_lsns``). With
   ``ack = "archived"`` no table can be ahead of the archive unless objects
   were deleted: that needs ``--accept-loss-from``.
   Derive the watermarks from the Delta tables on S3: each stream's commits of
   app id ``eventplane/<WAL id>/<stream>`` (a mirror's: ``.../mirror/<name>``)
   give its last batch id (the txn version) and per core its last LSN (the
   commits' ``userMetadata``). The watermarks are the lowest table's; the
   batches up to the highest table's are planned again with the ranges the
   tables ahead committed, so the stages behind re-run exactly those; batch
   ids go on above, no committed LSN is appended again.
5. Move into place: ``watermarks.json``, ``plans.log`` and the DLQ (from the
   archive's copy, daemon/dlqcopy.py) first, then ``wal/``
   (a rename). A kill before that leaves no WAL: ``run`` still refuses, a new
   restore starts over.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog

from daemon.config import Config
from daemon.errors import ArchiveRefusedError
from daemon.plane.watermarks import FILENAME as WATERMARKS_FILENAME
from daemon.plane.watermarks import WatermarkSnapshot, WatermarkStore
from daemon.table.crash import crash_point
from daemon.table.s3 import Location, client
from wal.archive import ArchiveFormatError, ObjectHeader, object_name, parse_header, parse_object
from wal.files import IDENTITY, create_segment, fsync_dir, write_identity
from wal.format import (
    FRAME_HEADER,
    MAX_LOST_PER_FRAME,
    SEGMENT_NAME_RE,
    encode_lost_frame,
    segment_name,
)

log = structlog.get_logger("eventplane.restore")

TMP = ".restore"


class RestoreRefused(Exception):
    """Restore stopped; nothing in the data_dir changed."""


@dataclass
class Summary:
    wal_id: str = ""
    first_lsn: int = 0
    last_lsn: int = 0
    objects: int = 0
    fences: int = 0
    bytes: int = 0
    seconds: float = 0.0
    lost: tuple[int, int | None] | None = None  # first, last LSN lost (None: unknown)
    lost_because: str = ""
    # LSNs tables committed that the archive never got: a lost frame covers them.
    lost_in_tables: tuple[int, int] | None = None
    epoch: int = 0
    tables: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    not_derived: list[str] = field(default_factory=list)
    batch_id: int = 0
    plans: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)
    unacknowledged: tuple[int, int] | None = None  # LSNs dropped that no answer acknowledged
    triggers_from: int = 0  # the trigger stage evaluates the events from this LSN again
    dlq: tuple[int, int, float] | None = None  # (entries, epoch, written at) of the DLQ's copy

    def lines(self) -> list[str]:
        out = [
            f"restored WAL {self.wal_id}: LSN {self.first_lsn}..{self.last_lsn}, "
            f"{self.objects} objects ({self.fences} fences), {self.bytes} bytes, "
            f"{self.seconds:.1f} s; every checksum verified; archive epoch now {self.epoch}",
        ]
        if self.lost is not None:
            first, last = self.lost
            out.append(
                f"LOST: LSN {first}..{last if last is not None else '?'} "
                f"({self.lost_because}); accepted with --accept-loss-from {first}"
            )
        if self.lost_in_tables is not None:
            first, last = self.lost_in_tables
            out.append(
                f"LOST from the WAL: LSN {first}..{last}: tables committed them, the archive "
                "never got them; the tables keep what they hold, a stage behind them and the "
                "triggers never see them; new events go on above LSN "
                f"{last}. Events acknowledged above it and in no table are gone without a trace "
                "(at most the unarchived window at the loss)"
            )
        if self.unacknowledged is not None:
            first, last = self.unacknowledged
            out.append(
                f"never acknowledged: LSN {first}..{last} (uploads in flight at the loss that "
                'never landed; with ack = "archived" no answer covered them): not restored'
            )
        for name, (bid, lsns) in sorted(self.tables.items()):
            out.append(f"table {name}: last batch {bid}, last LSN per core {lsns}")
        if self.plans:
            out.append(
                f"batches {min(self.plans)}..{max(self.plans)} planned again as the tables "
                "ahead committed them (the stages behind re-run them)"
            )
        if self.triggers_from:
            out.append(
                f"triggers: every event from LSN {self.triggers_from} is evaluated again "
                "(the retry queue was on the lost disk; at least once)"
            )
        if self.dlq is not None:
            entries, epoch, at = self.dlq
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
            out.append(
                f"DLQ: {entries} entries from the archive's copy of {when} (epoch {epoch}); "
                "the triggers evaluate the restored events above the watermarks again, so a "
                "row dead-lettered after the copy comes back and one before it may twice"
            )
        for why in self.not_derived:
            out.append(f"not derived: {why}")
        out.append(f"batch ids go on above {self.batch_id}")
        return out


class _Segments:
    """Frames written byte for byte into segment files, one per segment stamp."""

    def __init__(self, directory: Path, wal_id: bytes) -> None:
        self.directory, self.wal_id = directory, wal_id
        self._fd = -1
        self.number = 0
        self.next_lsn = 0
        self.first_lsn = 0

    def add(self, first_lsn: int, events: int, frame: bytes, where: str) -> None:
        stamp = FRAME_HEADER.unpack_from(frame, 0)[5]
        if stamp != self.number:
            if self.number and stamp != self.number + 1:
                raise ArchiveFormatError(
                    f"{where}: a frame of segment {stamp} follows segment {self.number}"
                )
            self._close()
            create_segment(self.directory, self.wal_id, stamp, first_lsn)
            self._fd = os.open(self.directory / segment_name(first_lsn), os.O_WRONLY | os.O_APPEND)
            self.number = stamp
            if not self.first_lsn:
                self.first_lsn = first_lsn
        view = memoryview(frame)
        while view:
            view = view[os.write(self._fd, view) :]
        self.next_lsn = first_lsn + events

    def _close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def finish(self) -> None:
        self._close()
        if not self.number:  # an archive without data objects: a WAL that starts at 1
            create_segment(self.directory, self.wal_id, 1, 1)
            self.first_lsn, self.next_lsn = 1, 1
        write_identity(self.directory, self.wal_id)
        fsync_dir(self.directory)


def has_wal(wal_dir: Path) -> bool:
    if not wal_dir.is_dir():
        return False
    return (wal_dir / IDENTITY).exists() or any(
        SEGMENT_NAME_RE.match(p.name) for p in wal_dir.iterdir()
    )


class _Progress:
    def __init__(self, out: IO[str] | None, total: int) -> None:
        self.out, self.total, self.last = out, total, 0.0

    def __call__(self, done: int, nbytes: int, final: bool = False) -> None:
        now = time.monotonic()
        if self.out is None or (not final and now - self.last < 0.2):
            return
        self.last = now
        width = 30
        full = width * done // max(self.total, 1)
        bar = "#" * full + "." * (width - full)
        self.out.write(f"\rrestore [{bar}] {done}/{self.total} objects, {nbytes} bytes")
        if final:
            self.out.write("\n")
        self.out.flush()


def restore(
    cfg: Config,
    *,
    accept_loss_from: int | None = None,
    progress: IO[str] | None = None,
    s3: Any = None,
    fetch: Callable[[Any, str, str, int], bytes] | None = None,
) -> Summary:
    """Steps 1-5 of the module doc; raises :class:`RestoreRefused`. ``fetch(s3,
    bucket, key, number)`` gives an object's bytes (a standby's cache,
    daemon/follow.py); every object is checked whole either way."""
    started = time.monotonic()
    arc = cfg.wal.archive
    if arc is None:
        raise RestoreRefused("the config has no [wal.archive]: there is nothing to restore from")
    if has_wal(cfg.wal_dir):
        raise RestoreRefused(
            f"{cfg.wal_dir} already holds a WAL: restore only rebuilds an empty data_dir "
            "(move it away first if it is really lost)"
        )
    where = Location.parse(arc.uri)
    s3 = s3 if s3 is not None else client(cfg.s3, self_checked=True)
    from daemon.walarchive import MANIFEST

    try:
        got = s3.get_object(Bucket=where.bucket, Key=where.key(MANIFEST))["Body"].read()
    except s3.exceptions.NoSuchKey:
        raise RestoreRefused(f"{arc.uri} holds no WAL ({MANIFEST} is missing)") from None
    wal_id = str(json.loads(got)["wal_id"])
    summary = Summary(wal_id=wal_id)
    prefix = where.key("wal/")
    numbers: list[int] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            name = item["Key"][len(prefix) :]
            if name.isdigit():
                numbers.append(int(name))
    numbers.sort()

    tmp = cfg.data_dir / TMP
    shutil.rmtree(tmp, ignore_errors=True)  # a restore killed before: start over
    tmp_wal = tmp / "wal"
    tmp_wal.mkdir(parents=True)
    segs = _Segments(tmp_wal, bytes.fromhex(wal_id))
    bar = _Progress(progress, len(numbers))
    masked = 0
    expected = 0  # the next LSN; 0 until the first data object
    fenced_at = 0  # the highest archived LSN a fence records
    problem: tuple[int, int, str] | None = None  # (index, first LSN lost, why)
    try:
        for i, number in enumerate(numbers):
            name = object_name(number)
            if fetch is not None:
                body = fetch(s3, where.bucket, prefix + name, number)
            else:
                body = s3.get_object(Bucket=where.bucket, Key=prefix + name)["Body"].read()
            try:
                head, frames = parse_object(body)
                if head.wal_id != wal_id:
                    raise ArchiveFormatError(
                        f"it is of WAL {head.wal_id}, the manifest's is {wal_id}"
                    )
                if head.number != number:
                    raise ArchiveFormatError(f"its header says object {head.number}")
            except ArchiveFormatError as exc:
                problem = (i, expected or 1, f"archive object {name} is damaged: {exc}")
                break
            summary.bytes += len(body)
            summary.objects += 1
            if head.fence:
                summary.fences += 1
                masked = max(masked, head.epoch)
                fenced_at = max(fenced_at, head.last_lsn)  # what the archive held then
            elif head.epoch >= masked:
                if expected and head.first_lsn != expected:
                    what = "missing" if head.first_lsn > expected else "overlapping"
                    problem = (
                        i,
                        expected,
                        f"LSN gap before archive object {name}: the objects before it end at LSN "
                        f"{expected - 1}, it starts at LSN {head.first_lsn} (objects {what}: "
                        "deleted by hand?)",
                    )
                    break
                for first, events, frame in frames:
                    segs.add(first, events, frame, f"archive object {name}")
                expected = head.last_lsn + 1
                crash_point("restore.mid_download")
            bar(i + 1, summary.bytes)
        bar(len(numbers) if problem is None else problem[0], summary.bytes, final=True)
        if problem is None and fenced_at > max(expected - 1, 0):
            problem = (
                len(numbers),
                max(expected, 1),
                f"the archive's objects end at LSN {expected - 1}, but a fence records that "
                f"it held LSNs up to {fenced_at}: its last objects are missing (deleted by hand?)",
            )
        if problem is not None:
            _on_problem(
                s3, where, numbers, problem, accept_loss_from, summary, wal_id, fenced_at, arc.ack
            )
        positions = _positions(cfg, wal_id, summary)
        restored_to = max(segs.next_lsn, 1) - 1
        _lost_in_tables(positions, restored_to, accept_loss_from, arc.ack, summary, segs)
        segs.finish()
        summary.first_lsn, summary.last_lsn = segs.first_lsn, restored_to
        if problem is not None:
            _move_lost(s3, where, numbers[problem[0] :])
        try:
            summary.epoch = asyncio.run(_take_over(cfg, tmp_wal))
        except ArchiveRefusedError as exc:  # a live holder, or objects that came meanwhile
            raise RestoreRefused(f"{exc}. Nothing was changed; run the restore again") from exc
        crash_point("restore.after_takeover")
        snap = _watermarks(cfg, wal_id, summary, positions)
        # Step 5: watermarks first (no WAL yet: run still refuses), then the WAL.
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        WatermarkStore(cfg.data_dir / WATERMARKS_FILENAME).save(snap)
        _write_plans(cfg, wal_id, summary)
        _restore_dlq(cfg, s3, where, wal_id, tmp, summary)
        crash_point("restore.after_watermarks")
        if cfg.wal_dir.exists():
            cfg.wal_dir.rmdir()  # empty (checked in step 1)
        os.rename(tmp_wal, cfg.wal_dir)
        fsync_dir(cfg.data_dir)
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary.seconds = time.monotonic() - started
    log.info(
        "restore.done",
        wal_id=wal_id,
        first_lsn=summary.first_lsn,
        last_lsn=summary.last_lsn,
        objects=summary.objects,
        bytes=summary.bytes,
        seconds=round(summary.seconds, 3),
        lost_from=summary.lost[0] if summary.lost else None,
        lost_to=summary.lost[1] if summary.lost else None,
        lost_in_tables=summary.lost_in_tables,
        batch_id=summary.batch_id,
    )
    return summary


def _on_problem(
    s3: Any,
    where: Location,
    numbers: list[int],
    problem: tuple[int, int, str],
    accept: int | None,
    summary: Summary,
    wal_id: str,
    fenced_at: int,
    ack: str = "local",
) -> None:
    index, first_lost, why = problem
    last: int | None = fenced_at if fenced_at >= first_lost else None
    after: list[tuple[int, ObjectHeader | None]] = []
    for number in numbers[index:]:
        head = _head(s3, where, number)
        after.append((number, head))
        if head is not None and head.wal_id == wal_id and not head.fence:
            last = max(last or 0, head.last_lsn)
    if ack == "archived" and index > 0 and first_lost > fenced_at:
        tail = _never_acknowledged(numbers[index - 1], _head(s3, where, numbers[index - 1]), after)
        if tail is not None and wal_id == tail[0]:
            summary.unacknowledged = (first_lost, tail[1])
            log.warning(
                "restore.unacknowledged_dropped",
                first_lsn=first_lost,
                last_lsn=tail[1],
                reason=why,
                message="uploads in flight at the loss never landed; with ack = "
                '"archived" none of these LSNs was acknowledged',
            )
            return
    lost = f"LSN {first_lost}..{last if last is not None else '?'}"
    if accept != first_lost:
        log.error("restore.refused", reason=why, lost=lost)
        raise RestoreRefused(
            f"{why}. Nothing was changed. Restoring what is before it would lose {lost}: "
            f"if that is accepted, run again with --accept-loss-from {first_lost}"
        )
    summary.lost = (first_lost, last)
    summary.lost_because = why
    log.warning("restore.lsns_lost", first_lsn=first_lost, last_lsn=last, reason=why)


def _head(s3: Any, where: Location, number: int) -> ObjectHeader | None:
    """The header of archive object ``number`` (None: missing or unreadable)."""
    try:
        got = s3.get_object(
            Bucket=where.bucket, Key=where.key(f"wal/{object_name(number)}"), Range="bytes=0-79"
        )
        return parse_header(got["Body"].read())
    except Exception:
        return None


def _never_acknowledged(
    before: int, prev: ObjectHeader | None, after: list[tuple[int, ObjectHeader | None]]
) -> tuple[str, int] | None:
    """A gap that only uploads in flight at a kill leave: ``(WAL id, last LSN
    after it)``, or None when an acknowledged object may be missing.

    A holder makes an object only while fewer than :data:`MAX_IN_FLIGHT` are
    not stored after its stored prefix, and an ``ack = "archived"`` answer
    waits for that prefix. So when the names missing start right after
    object ``before`` (``prev``, the last one that counts) and every object
    after them is a data object of ``prev``'s epoch below ``before + 1 +
    MAX_IN_FLIGHT`` (no later holder fenced them), nothing from the gap on was
    ever acknowledged; the caller has checked that no fence records it as
    archived either. Anything else (a deeper hole, a later epoch, an object
    that does not parse) may be a deletion by hand, and is refused."""
    from daemon.walarchive import MAX_IN_FLIGHT

    if prev is None or not after or after[0][0] == before + 1:
        return None
    last = 0
    for number, head in after:
        if head is None or head.fence or head.epoch != prev.epoch or head.wal_id != prev.wal_id:
            return None
        if number >= before + 1 + MAX_IN_FLIGHT:
            return None
        last = max(last, head.last_lsn)
    return prev.wal_id, last


def _move_lost(s3: Any, where: Location, numbers: list[int]) -> None:
    """The objects from the bad one on go to ``<uri>/lost/``: the archive then
    ends where the restored WAL does, and the next holder writes above it."""
    for number in numbers:
        name = object_name(number)
        key = where.key(f"wal/{name}")
        try:
            s3.copy_object(
                Bucket=where.bucket,
                Key=where.key(f"lost/{name}"),
                CopySource={"Bucket": where.bucket, "Key": key},
            )
        except s3.exceptions.NoSuchKey:
            continue
        except Exception as exc:
            if "NoSuchKey" not in str(exc) and "404" not in str(exc):
                raise
            continue
        s3.delete_object(Bucket=where.bucket, Key=key)
        log.warning("restore.object_moved_aside", object=name, to=f"lost/{name}")


async def _take_over(cfg: Config, wal_dir: Path) -> int:
    """Step 3: what ``run`` does at a start (the next epoch, the fences), then release."""
    from daemon.metrics import Metrics
    from daemon.walarchive import WalArchive
    from wal import Wal

    assert cfg.wal.archive is not None
    wal = await asyncio.to_thread(Wal.open, wal_dir, segment_bytes=cfg.wal.segment_bytes)
    try:
        archive = WalArchive(cfg.wal.archive, cfg.s3, wal, str(cfg.data_dir), Metrics())
        await archive.open()
        await archive.stop(0.0)
        return archive.epoch
    finally:
        await wal.aclose()


Ranges = dict[int, tuple[int, int]]


@dataclass
class _Position:
    """One table's progress as its Delta log records it (step 4)."""

    batch_id: int = 0  # the txn version of its app id
    high: dict[int, int] = field(default_factory=dict)  # core -> last LSN committed
    plans: dict[int, Ranges] = field(default_factory=dict)  # batch id -> its ranges


def _table_position(files: Any, app: str) -> _Position:
    """The commits of app id ``app`` in the table's log: each one's ``txn``
    version is its batch id, its ``userMetadata`` the batch's ranges."""
    from daemon.table.fence import log_commits

    out = _Position()
    for _version, actions in log_commits(files, -1):
        txns = [t for t in actions.get("txn", []) if t.get("appId") == app]
        meta = json.loads(actions.get("commitInfo", {}).get("userMetadata") or "{}").get(
            "eventplane"
        )
        if not txns or meta is None:
            continue
        bid = int(txns[0]["version"])
        out.batch_id = max(out.batch_id, bid)
        ranges = {int(c): (int(a), int(b)) for c, (a, b) in meta["ranges"].items()}
        out.plans[bid] = ranges
        for core, (_first, last) in ranges.items():
            out.high[core] = max(out.high.get(core, 0), last)
    return out


def _stream_position(stream: Any, wal_id: str) -> _Position:
    from daemon.table.delta import app_id
    from daemon.table.location import table_files

    return _table_position(table_files(stream), app_id(wal_id, stream.name))


def _mirror_position(mirror: Any, wal_id: str) -> _Position:
    """A mirror commits only the batches that have rows of its collection, with
    the batch's ranges: its state is the fold of its collection up to ``high``
    and of nothing above (a later event would be in a later commit)."""
    from daemon.table.location import S3Files
    from daemon.table.mirror import app_id

    return _table_position(S3Files(mirror.uri, mirror.s3), app_id(wal_id, mirror.name))


def _replans(positions: dict[str, _Position], low: int, top: int) -> dict[int, Ranges] | None:
    """The plans of batches ``low+1..top`` as the tables ahead committed them,
    so the stages behind re-run exactly those batches (as after a crash) and
    the planner goes on above ``top``; None if a batch id is in no table."""
    plans: dict[int, Ranges] = {}
    for pos in positions.values():
        for bid, ranges in pos.plans.items():
            if low < bid <= top:
                plans.setdefault(bid, ranges)
    return plans if set(plans) == set(range(low + 1, top + 1)) else None


def _positions(cfg: Config, wal_id: str, summary: Summary) -> dict[str, _Position]:
    """Step 4: each Delta stream's and mirror's position on S3; the others are
    named in ``summary.not_derived``."""
    positions: dict[str, _Position] = {}
    for stream in cfg.cdc.streams:
        if stream.format != "delta" or not stream.uri:
            summary.not_derived.append(
                f"stream {stream.name!r} ({stream.format} at {stream.uri or stream.path}): only "
                "Delta tables on S3 are read; it starts as a stream new to this data_dir"
            )
            continue
        positions[f"cdc:{stream.name}"] = _stream_position(stream, wal_id)
    for mirror in cfg.cdc.mirrors:
        if not mirror.uri:
            summary.not_derived.append(
                f"mirror {mirror.name!r} ({mirror.path}): only mirrors on S3 are read; it "
                "lived on the lost disk and is rebuilt from the restored WAL's events only"
            )
            continue
        positions[f"mirror:{mirror.name}"] = _mirror_position(mirror, wal_id)
    for stage, pos in positions.items():
        summary.tables[stage] = (
            pos.batch_id,
            [pos.high.get(c, 0) for c in range(cfg.daemon.cores)],
        )
    return positions


def _lost_in_tables(
    positions: dict[str, _Position],
    restored_to: int,
    accept: int | None,
    ack: str,
    summary: Summary,
    segs: _Segments,
) -> None:
    """Step 4: tables that hold LSNs above ``restored_to`` (the last one restored)
    get a WAL that goes on above them: lost frames cover the LSNs between."""
    highs = {stage: max(p.high.values()) for stage, p in positions.items() if p.high}
    top = max(highs.values(), default=0)
    if top <= restored_to:
        return
    first = restored_to + 1
    ahead = sorted(stage for stage, high in highs.items() if high > restored_to)
    why = f"{', '.join(ahead)} holds LSNs up to {top}, the archive ends at LSN {restored_to}"
    if ack == "archived" and accept != first and summary.lost is None:
        # Stages take only archived events in this mode: the archive lost its last objects.
        log.error("restore.refused", reason=why, lost=f"LSN {first}..{top}")
        raise RestoreRefused(
            f'{why}: with ack = "archived" that means the archive\'s last objects are '
            "missing (deleted by hand?). Nothing was changed. Restoring would lose LSN "
            f"{first}..{top} from the WAL: if that is accepted, run again with "
            f"--accept-loss-from {first}"
        )
    stamp = segs.number or 1
    lsn = first
    while lsn <= top:
        count = min(top - lsn + 1, MAX_LOST_PER_FRAME)
        segs.add(lsn, count, encode_lost_frame(stamp, lsn, count), "the lost frame")
        lsn += count
    summary.lost_in_tables = (first, top)
    log.warning(
        "restore.lsns_lost",
        first_lsn=first,
        last_lsn=top,
        reason=f"{why}: tables committed them, the archive never got them",
        tables=ahead,
    )


def _watermarks(
    cfg: Config, wal_id: str, summary: Summary, positions: dict[str, _Position]
) -> WatermarkSnapshot:
    """Step 4. Every core's events below the restored WAL's first LSN were
    committed by every stage (the archive prunes only below every reader).
    Each Delta stream and mirror on S3 gives its position; the watermarks are
    the lowest, and the batches between the lowest and the highest table are
    planned again from the tables' own records (``summary.plans``)."""
    cores = cfg.daemon.cores
    floor = summary.first_lsn - 1
    if not positions:
        return WatermarkSnapshot(wal_id, cores, 0, tuple(max(floor, 0) for _ in range(cores)))
    batch_id = min(p.batch_id for p in positions.values())
    top = max(p.batch_id for p in positions.values())
    lsns = tuple(
        max(floor, min(p.high.get(c, 0) for p in positions.values())) for c in range(cores)
    )
    summary.batch_id = top
    plans = _replans(positions, batch_id, top)
    if plans is None and all(stage.startswith("mirror:") for stage in positions):
        # Mirrors only: a merge never takes a key back (``t.lsn < s.lsn``), so
        # each one may take again what it holds; what it must not meet is a
        # batch id at or below its txn version (a merge it would skip).
        batch_id = top
        plans = {}
        for pos in positions.values():
            pos.batch_id = top
    if plans is None:
        summary.not_derived.append(
            f"the tables are not level (last batches {batch_id}..{top}) and no table records "
            "every batch between: the watermarks are the lowest; a table ahead skips the "
            "batches up to its own (see docs/operating.md)"
        )
    else:
        summary.plans = plans
    progress = {stage: pos.batch_id for stage, pos in positions.items()}
    if cfg.triggers and batch_id > 0:
        batch_id, lsns = _triggers_from_floor(cfg, summary, progress, batch_id, lsns)
    return WatermarkSnapshot(wal_id, cores, batch_id, lsns, tuple(sorted(progress.items())))


def _triggers_from_floor(
    cfg: Config,
    summary: Summary,
    progress: dict[str, int],
    low: int,
    lsns: tuple[int, ...],
) -> tuple[int, tuple[int, ...]]:
    """The trigger stage evaluates again every event the restored WAL holds
    below the tables' batches: its retry queue was lost with the disk, and the
    archive keeps every row still in it (the retention floor, invariant 9), so
    at least once holds.

    Those events are planned again as batches ``low - n + 1 .. low`` (at most
    ``microbatch.max_rows`` events of a core each); every other stage is level
    with ``low`` or ahead and skips them, the triggers stand at ``low - n``.
    Returns the watermarks' batch id and LSNs."""
    from wal import Wal

    floor = summary.first_lsn - 1
    chunks: dict[int, list[tuple[int, int]]] = {}
    wal = Wal.open(cfg.data_dir / TMP / "wal", segment_bytes=cfg.wal.segment_bytes)
    try:
        for core in range(cfg.daemon.cores):
            starts = [r[core][0] for r in summary.plans.values() if core in r]
            end = min(starts) - 1 if starts else lsns[core]
            if end <= floor:
                continue
            got = [
                lsn for b in wal.read_batches(floor + 1, core=core, to_lsn=end) for lsn in b.lsns
            ]
            if got:
                size = max(cfg.microbatch.max_rows, -(-len(got) // low))
                chunks[core] = [
                    (got[i], got[min(i + size, len(got)) - 1]) for i in range(0, len(got), size)
                ]
    finally:
        wal.close()
    if not chunks:
        return low, lsns
    n = max(len(c) for c in chunks.values())
    for i in range(n):
        summary.plans[low - n + 1 + i] = {c: ch[i] for c, ch in chunks.items() if i < len(ch)}
    for stream in cfg.cdc.streams:
        progress.setdefault(f"cdc:{stream.name}", low)
    for mirror in cfg.cdc.mirrors:
        progress.setdefault(f"mirror:{mirror.name}", low)
    for handler in cfg.cdc.handlers:
        progress.setdefault(f"handler:{handler.function}", low)
    progress["triggers"] = low - n
    summary.triggers_from = floor + 1
    return low - n, tuple(floor if c in chunks else lsn for c, lsn in enumerate(lsns))


def _restore_dlq(
    cfg: Config, s3: Any, where: Location, wal_id: str, tmp: Path, summary: Summary
) -> None:
    """Step 5: the DLQ from the archive's newest copy (daemon/dlqcopy.py) into
    ``triggers/queue.sqlite3``; a store file already there is moved aside."""
    from daemon.dlqcopy import restore_dlq
    from triggers.store import store_path

    staged = tmp / "queue.sqlite3"
    try:
        got = restore_dlq(s3, where, wal_id, staged)
    except ValueError as exc:
        summary.not_derived.append(f"the DLQ: its copy is not usable ({exc}); it starts empty")
        log.error("restore.dlq_copy_unusable", error=str(exc))
        return
    if got is None:
        return
    target = store_path(cfg.data_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm"):
        old = target.with_name(target.name + suffix)
        if old.exists():
            aside = old.with_name(f"{old.name}.before-restore")
            os.replace(old, aside)
            if not suffix:
                summary.not_derived.append(f"the trigger store there was moved to {aside}")
    os.replace(staged, target)
    fsync_dir(target.parent)
    summary.dlq = got


def _write_plans(cfg: Config, wal_id: str, summary: Summary) -> None:
    """Step 5: the batches the tables ahead committed, planned again (or none)."""
    from daemon.plane.planlog import FILENAME, PlanLog

    path = cfg.data_dir / FILENAME
    path.unlink(missing_ok=True)
    if summary.plans:
        plans = PlanLog(path, wal_id, cfg.daemon.cores)
        plans.rewrite(summary.plans)
        plans.close()


def main(cfg: Config, accept_loss_from: int | None, out: IO[str] = sys.stdout) -> int:
    # The log to stderr: stdout is the summary.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        summary = restore(cfg, accept_loss_from=accept_loss_from, progress=sys.stderr)
    except RestoreRefused as exc:
        print(f"eventplane restore: {exc}", file=sys.stderr)
        return 1
    for line in summary.lines():
        print(line, file=out)
    return 0


def archive_holds_wal(cfg: Config) -> str | None:
    """``run`` on a data_dir without a WAL: the WAL id the archive already holds, if any."""
    manifest = archive_manifest(cfg)
    return None if manifest is None else str(manifest.get("wal_id") or "") or None


def archive_manifest(cfg: Config) -> dict[str, Any] | None:
    """``run`` on a data_dir without a WAL: the archive's manifest, if it has one."""
    arc = cfg.wal.archive
    if arc is None or has_wal(cfg.wal_dir):
        return None
    from daemon.walarchive import MANIFEST

    where = Location.parse(arc.uri)
    s3 = client(cfg.s3)
    try:
        got = s3.get_object(Bucket=where.bucket, Key=where.key(MANIFEST))["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None
    manifest: dict[str, Any] = json.loads(got)
    return manifest
