"""Finding, checking and scanning segment files.

Shared by :meth:`wal.Wal.open` (recovery), ``eventplane wal verify|inspect|repair``.
A scan never changes a file: it returns the valid prefix of the log and, when
it stopped early, a :class:`Damage` that says where, why, whether it is a torn
tail (cut on open) and what lies beyond it (for repair's loss report).
"""

from __future__ import annotations

import mmap
import os
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from wal.format import (
    SEGMENT_HEADER_SIZE,
    SEGMENT_NAME_RE,
    Frame,
    RequestEntry,
    SegmentHeader,
    check_frame,
    check_frame_deep,
    find_frame_after,
    frame_requests,
    parse_segment_header,
)


def _u64() -> array[int]:
    return array("Q")


@dataclass(slots=True, eq=False)
class Segment:
    """One segment file and what a scan learned about it.

    The writer thread appends to ``frame_offsets``/``frame_lsns`` and then moves
    ``end``/``next_lsn``; readers only trust bytes below the ``end`` they read.
    """

    path: Path
    number: int
    first_lsn: int
    end: int = SEGMENT_HEADER_SIZE  # offset after the last whole (durable) frame
    next_lsn: int = 0  # first LSN after this segment's frames
    frame_offsets: array[int] = field(default_factory=_u64)  # sparse index: frame offsets
    frame_lsns: array[int] = field(default_factory=_u64)  # ... and their first LSNs
    sealed: bool = True  # no more frames will be written to it
    core_counts: Counter[int] = field(default_factory=Counter)  # filled by scans with counts
    lost: list[tuple[int, int]] = field(default_factory=list)  # LSN ranges of its lost frames

    def __post_init__(self) -> None:
        if self.next_lsn == 0:
            self.next_lsn = self.first_lsn

    @property
    def last_lsn(self) -> int:
        """Last LSN in the segment; ``first_lsn - 1`` when it holds no frame."""
        return self.next_lsn - 1

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True, slots=True)
class Damage:
    """Where a scan stopped, and what lies beyond that point."""

    path: Path
    offset: int  # first byte that is not part of the valid log
    reason: str
    torn: bool  # torn tail of the last segment (or its torn creation): cut on open
    file_size: int
    next_lsn: int  # first LSN the damage hides
    last_seen_lsn: int  # highest LSN of any intact frame beyond the damage
    later_files: tuple[Path, ...] = ()  # segment files after the damaged one (all lost)
    whole_file: bool = False  # the damage is the file itself (header, order, identity)

    @property
    def segment(self) -> str:
        return self.path.name


@dataclass(slots=True)
class Scan:
    segments: list[Segment]  # the valid prefix, in LSN order
    damage: Damage | None = None
    strays: list[tuple[Path, str]] = field(default_factory=list)  # copies of other segments
    frames: int = 0


Progress = Callable[[int, int], None]  # (bytes scanned so far, bytes in total)
OnRequests = Callable[[list[RequestEntry]], None]  # a valid frame's request table


def segment_files(directory: Path) -> list[Path]:
    """Segment files in first-LSN order (the zero-padded names sort that way)."""
    return sorted(
        (p for p in directory.iterdir() if SEGMENT_NAME_RE.match(p.name) and p.is_file()),
        key=lambda p: p.name,
    )


def _name_lsn(path: Path) -> int:
    match = SEGMENT_NAME_RE.match(path.name)
    return int(match.group(1)) if match else -1


def _read_prefix(path: Path, size: int) -> bytes:
    with path.open("rb") as f:
        return f.read(size)


def last_lsn_beyond(buf: bytes | mmap.mmap, start: int, limit: int, number: int, lsn: int) -> int:
    """Highest LSN of intact frames after ``start`` (for loss reports); ``lsn - 1`` if none."""
    best = lsn - 1
    pos = start
    while True:
        found = find_frame_after(buf, pos, limit, number, lsn)
        if found is None:
            return best
        best = max(best, found.first_lsn + found.events - 1)
        pos = found.offset + found.size


def scan(
    directory: Path,
    wal_id: bytes | None,
    *,
    deep: bool = False,
    counts: bool = False,
    progress: Progress | None = None,
    on_requests: OnRequests | None = None,
) -> Scan:
    """Check every segment header and frame; return the valid prefix and the first damage.

    ``on_requests`` gets the request table of every frame of the valid prefix
    that has one, in LSN order (recovery rebuilds the de-duplication window).

    Order of checks:

    1. Every header parses. A torn header is a torn tail only on the last file
       and only when the file is no longer than a header (a crash while
       creating it: the header is fsynced before any frame is written).
    2. Every header carries ``wal_id``.
    3. File names agree with the header's first LSN. A misnamed file whose
       segment number a well-named file also holds is a *stray* copy (reported,
       not used); any other misnamed file is damage.
    4. Segment numbers are consecutive, LSNs contiguous across segments.
    5. Frames: intact, stamped with their segment, LSNs contiguous. A bad frame
       in the last segment with no intact frame after it is a torn tail;
       anything else is damage.
    """
    files = segment_files(directory)
    sizes = {p: p.stat().st_size for p in files}
    result = Scan(segments=[])

    # Steps 1-3. Headers, identity, names; stop at the first damaged file.
    bad: tuple[Path, str, bool] | None = None  # (file, reason, torn)
    headers: list[tuple[Path, SegmentHeader]] = []
    for i, path in enumerate(files):
        header = parse_segment_header(_read_prefix(path, SEGMENT_HEADER_SIZE))
        if isinstance(header, str):
            bad = (path, header, i == len(files) - 1 and sizes[path] <= SEGMENT_HEADER_SIZE)
            break
        if wal_id is not None and header.wal_id != wal_id:
            why = f"segment belongs to WAL {header.wal_id.hex()}, IDENTITY says {wal_id.hex()}"
            bad = (path, why, False)
            break
        headers.append((path, header))
    well_named = {h.number: p for p, h in headers if _name_lsn(p) == h.first_lsn}
    kept: list[tuple[Path, SegmentHeader]] = []
    for path, header in headers:
        if _name_lsn(path) == header.first_lsn:
            kept.append((path, header))
            continue
        why = f"header says segment {header.number}, first LSN {header.first_lsn}"
        original = well_named.get(header.number)
        if original is not None:
            result.strays.append((path, f"copy of {original.name} ({why})"))
            continue
        if bad is None or path.name < bad[0].name:
            bad = (path, f"file name disagrees with its header ({why})", False)
    if bad is not None:
        kept = [(p, h) for p, h in kept if p.name < bad[0].name]
    strays = {p for p, _why in result.strays}

    def damage_at(
        path: Path, offset: int, reason: str, torn: bool, next_lsn: int, last_seen: int, whole: bool
    ) -> Scan:
        later = tuple(p for p in files if p.name > path.name and p not in strays)
        result.damage = Damage(
            path, offset, reason, torn, sizes[path], next_lsn, last_seen, later, whole
        )
        return result

    # Steps 4-5. Order, contiguity, frames.
    total = sum(sizes[p] for p, _h in kept) or 1
    done = 0
    prev: Segment | None = None
    for i, (path, header) in enumerate(kept):
        if prev is not None:
            expected = prev.next_lsn
            reason: str | None = None
            if header.number == prev.number:
                reason = f"duplicated segment number {header.number} (also {prev.name})"
            elif header.number != prev.number + 1:
                reason = (
                    f"segment(s) {prev.number + 1}..{header.number - 1} missing between "
                    f"{prev.name} and {path.name}"
                    if header.number > prev.number
                    else f"out of order: segment {header.number} follows segment {prev.number}"
                )
            elif header.first_lsn != expected:
                what = "records missing" if header.first_lsn > expected else "overlap"
                reason = (
                    f"segment starts at LSN {header.first_lsn} but the log before it ends "
                    f"at LSN {expected - 1} ({what})"
                )
            if reason is not None:
                return damage_at(path, 0, reason, False, expected, expected - 1, True)
        seg = Segment(path=path, number=header.number, first_lsn=header.first_lsn)
        is_last = i == len(kept) - 1 and bad is None
        frame_damage = _scan_frames(seg, sizes[path], deep, counts, is_last, result, on_requests)
        result.segments.append(seg)
        if frame_damage is not None:
            offset, reason, torn, last_seen = frame_damage
            return damage_at(path, offset, reason, torn, seg.next_lsn, last_seen, False)
        prev = seg
        done += sizes[path]
        if progress is not None:
            progress(done, total)
    if bad is not None:
        path, reason, torn = bad
        next_lsn = prev.next_lsn if prev is not None else max(_name_lsn(path), 1)
        return damage_at(path, 0, reason, torn, next_lsn, next_lsn - 1, True)
    return result


def _scan_frames(
    seg: Segment,
    size: int,
    deep: bool,
    counts: bool,
    is_last: bool,
    result: Scan,
    on_requests: OnRequests | None = None,
) -> tuple[int, str, bool, int] | None:
    """Walk the frames of one segment, filling its index.

    Returns None, or (offset, reason, torn, last LSN seen beyond the damage).
    """
    if size <= SEGMENT_HEADER_SIZE:
        seg.end = SEGMENT_HEADER_SIZE
        return None
    fd = os.open(seg.path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
            mm.madvise(mmap.MADV_SEQUENTIAL)
            off = SEGMENT_HEADER_SIZE
            lsn = seg.first_lsn
            while off < size:
                frame = check_frame(mm, off, size, seg.number)
                reason: str | None
                if isinstance(frame, str):
                    reason = frame
                elif frame.first_lsn != lsn:
                    reason = f"frame starts at LSN {frame.first_lsn}, expected LSN {lsn}"
                else:
                    reason = check_frame_deep(mm, frame) if deep else None
                if reason is not None or not isinstance(frame, Frame):
                    seg.end = off
                    seg.next_lsn = lsn
                    last_seen = last_lsn_beyond(mm, off + 1, size, seg.number, lsn)
                    # Intact frames after the damage hold data that was written
                    # (and maybe acknowledged) later: that is not a torn tail.
                    torn = is_last and isinstance(frame, str) and last_seen < lsn
                    return off, reason or "unreadable frame", torn, last_seen
                seg.frame_offsets.append(off)
                seg.frame_lsns.append(lsn)
                if counts:
                    for sec in frame.sections:
                        seg.core_counts[sec.core] += sec.events
                if frame.requests and on_requests is not None:
                    on_requests(frame_requests(mm, frame))
                if frame.lost:
                    seg.lost.append((lsn, lsn + frame.events - 1))
                off += frame.size
                lsn += frame.events
                result.frames += 1
            seg.end = off
            seg.next_lsn = lsn
            return None
    finally:
        os.close(fd)
