"""``eventplane wal inspect|verify|repair``: look at, check and (when asked) cut a WAL.

``inspect`` and ``verify`` never change a file. ``repair`` takes the WAL's
lock (the daemon must be stopped), prints exactly what it would lose and asks
before it cuts; what it cuts is kept aside as ``.broken`` files, never deleted.
Exit codes: 0 fine, 1 damage found / refused / aborted, 2 no WAL there.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from wal.errors import WalError, WalLockedError
from wal.files import fsync_dir, lock_directory, read_identity, save_aside
from wal.format import SEGMENT_HEADER_SIZE, parse_segment_header
from wal.segments import Damage, Scan, Segment, last_lsn_beyond, scan

EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_NO_WAL = 2


def _mib(n: int) -> str:
    """Human-readable byte count (binary units)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _open_scan(
    directory: Path, out: TextIO, *, deep: bool, counts: bool, progress: bool = False
) -> tuple[bytes, Scan] | int:
    if not directory.is_dir():
        print(f"no WAL at {directory}: the directory does not exist", file=out)
        return EXIT_NO_WAL
    try:
        wal_id = read_identity(directory)
    except WalError as exc:
        print(f"cannot read the WAL's identity: {exc}", file=out)
        return EXIT_DAMAGED
    if wal_id is None:
        print(f"no WAL at {directory}: there is no IDENTITY file", file=out)
        return EXIT_NO_WAL
    bar = _ProgressBar(sys.stderr) if progress else None
    result = scan(directory, wal_id, deep=deep, counts=counts, progress=bar)
    if bar is not None:
        bar.done()
    return wal_id, result


class _ProgressBar:
    """A one-line progress bar on a terminal (stderr), redrawn per segment."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __call__(self, done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        self.stream.write(
            f"\rverify [{'#' * filled}{'.' * (width - filled)}] {100 * done // max(total, 1):3d}% "
            f"{_mib(done)} of {_mib(total)}"
        )
        self.stream.flush()

    def done(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _describe_damage(damage: Damage) -> str:
    where = f"{damage.segment} @ byte offset {damage.offset}"
    if damage.torn:
        return (
            f"torn tail: {where}: {damage.reason}. Opening the WAL cuts the last "
            f"{damage.file_size - damage.offset} byte(s) (kept as {damage.segment}.broken); "
            f"they hold no complete frame, so nothing acknowledged is lost"
        )
    return (
        f"DAMAGE: {where}: {damage.reason}. The WAL refuses to open; events from LSN "
        f"{damage.next_lsn} on are affected. `eventplane wal repair` cuts the log here"
    )


# ---------------------------------------------------------------------------- inspect


def inspect(directory: Path, out: TextIO) -> int:
    """Print segments, their LSN ranges and per-core event counts."""
    opened = _open_scan(directory, out, deep=False, counts=True)
    if isinstance(opened, int):
        return opened
    wal_id, result = opened
    segs = result.segments
    total_bytes = sum(s.end for s in segs)
    head = segs[-1].last_lsn if segs else 0
    floor = segs[0].first_lsn if segs else 1
    print(f"WAL {wal_id.hex()} in {directory}", file=out)
    print(
        f"{len(segs)} segment(s), LSN {floor}..{head} (retained floor {min(floor, head + 1)}, "
        f"head {head}), {_mib(total_bytes)}",
        file=out,
    )
    print(file=out)
    print(
        f"{'segment':26} {'no.':>5} {'first LSN':>12} {'last LSN':>12} {'frames':>7} "
        f"{'bytes':>11}  events by core",
        file=out,
    )
    totals: Counter[int] = Counter()
    for seg in segs:
        totals.update(seg.core_counts)
        cores = " ".join(f"{c}:{k}" for c, k in sorted(seg.core_counts.items())) or "-"
        last = str(seg.last_lsn) if seg.last_lsn >= seg.first_lsn else "(empty)"
        print(
            f"{seg.name:26} {seg.number:>5} {seg.first_lsn:>12} {last:>12} "
            f"{len(seg.frame_offsets):>7} {_mib(seg.end):>11}  {cores}",
            file=out,
        )
    print(file=out)
    by_core = " ".join(f"{c}:{k}" for c, k in sorted(totals.items())) or "none"
    print(f"events by core: {by_core} (total {sum(totals.values())})", file=out)
    _print_lost(segs, out)
    for path, why in result.strays:
        print(f"STRAY FILE: {path.name}: {why}", file=out)
    if result.damage is not None:
        print(_describe_damage(result.damage), file=out)
    damaged = result.strays or (result.damage is not None and not result.damage.torn)
    return EXIT_DAMAGED if damaged else EXIT_OK


def _print_lost(segs: list[Segment], out: TextIO) -> None:
    for seg in segs:
        for first, last in seg.lost:
            print(
                f"LOST: LSN {first}..{last} hold no event ({seg.name}): tables committed "
                "them, the archive never got them (a restore after a loss)",
                file=out,
            )


# ---------------------------------------------------------------------------- verify


def verify(directory: Path, out: TextIO, progress: bool) -> int:
    """Check every frame (CRC, stamps, LSN order, per-event arrays); change nothing."""
    opened = _open_scan(directory, out, deep=True, counts=True, progress=progress)
    if isinstance(opened, int):
        return opened
    _wal_id, result = opened
    segs = result.segments
    events = sum(sum(s.core_counts.values()) for s in segs)
    head = segs[-1].last_lsn if segs else 0
    print(
        f"checked {len(segs)} segment(s), {result.frames} frame(s), {events} event(s), "
        f"LSN {segs[0].first_lsn if segs else 1}..{head}",
        file=out,
    )
    _print_lost(segs, out)
    for path, why in result.strays:
        print(
            f"STRAY FILE: {path.name}: {why}. The WAL refuses to open while it is there", file=out
        )
    if result.damage is not None:
        print(_describe_damage(result.damage), file=out)
    if result.strays or (result.damage is not None and not result.damage.torn):
        return EXIT_DAMAGED
    print("OK", file=out)
    return EXIT_OK


# ---------------------------------------------------------------------------- repair


@dataclass(frozen=True, slots=True)
class _Action:
    path: Path
    offset: int  # cut from here (0 with whole=True: move the whole file aside)
    size: int
    whole: bool
    first_lsn: int | None  # LSN range the action loses (None: no intact events)
    last_lsn: int | None
    note: str


def _file_lsns(path: Path) -> tuple[int | None, int | None]:
    """(first, last) LSN of the intact frames in a file, scanning leniently."""
    size = path.stat().st_size
    with path.open("rb") as f:
        header = parse_segment_header(f.read(SEGMENT_HEADER_SIZE))
    if isinstance(header, str) or size <= SEGMENT_HEADER_SIZE:
        return None, None
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
            last = last_lsn_beyond(mm, SEGMENT_HEADER_SIZE, size, header.number, header.first_lsn)
    finally:
        os.close(fd)
    return (header.first_lsn, last) if last >= header.first_lsn else (None, None)


def _plan(result: Scan) -> list[_Action]:
    actions = [
        _Action(p, 0, p.stat().st_size, True, None, None, f"stray copy ({why}); loses nothing")
        for p, why in result.strays
    ]
    damage = result.damage
    if damage is None:
        return actions
    if damage.whole_file:
        first, last = _file_lsns(damage.path)
        actions.append(_Action(damage.path, 0, damage.file_size, True, first, last, damage.reason))
    else:
        lost = damage.last_seen_lsn >= damage.next_lsn
        actions.append(
            _Action(
                damage.path,
                damage.offset,
                damage.file_size,
                False,
                damage.next_lsn if lost else None,
                damage.last_seen_lsn if lost else None,
                damage.reason,
            )
        )
    for path in damage.later_files:
        first, last = _file_lsns(path)
        actions.append(_Action(path, 0, path.stat().st_size, True, first, last, "after the cut"))
    return actions


def repair(directory: Path, out: TextIO, assume_yes: bool) -> int:
    """Cut the WAL at its first bad frame (or file), after printing what is lost and asking."""
    if not directory.is_dir():
        print(f"no WAL at {directory}: the directory does not exist", file=out)
        return EXIT_NO_WAL
    try:
        lock_fd = lock_directory(directory, {"command": "eventplane wal repair"})
    except WalLockedError as exc:
        print(f"refusing to repair: {exc}", file=out)
        return EXIT_DAMAGED
    try:
        opened = _open_scan(directory, out, deep=True, counts=False)
        if isinstance(opened, int):
            return opened
        wal_id, result = opened
        actions = _plan(result)
        if not actions:
            print("nothing to repair: every segment and frame is intact", file=out)
            return EXIT_OK
        print(f"repair plan for WAL {wal_id.hex()} in {directory}:", file=out)
        lost_lo: int | None = None
        lost_hi: int | None = None
        for a in actions:
            if a.whole:
                what = f"move aside the whole file ({a.size} bytes)"
            else:
                what = f"cut bytes {a.offset}..{a.size} ({a.size - a.offset} bytes)"
            lsns = (
                f"LSN {a.first_lsn}..{a.last_lsn}"
                if a.first_lsn is not None and a.last_lsn is not None
                else "no intact events"
            )
            print(f"  {a.path.name}: {what}; loses {lsns}; {a.note}", file=out)
            if a.first_lsn is not None and a.last_lsn is not None:  # strays lose nothing
                lost_lo = a.first_lsn if lost_lo is None else min(lost_lo, a.first_lsn)
                lost_hi = a.last_lsn if lost_hi is None else max(lost_hi, a.last_lsn)
        if lost_lo is not None and lost_hi is not None:
            print(
                f"events LOST: LSN {lost_lo}..{lost_hi} ({lost_hi - lost_lo + 1} events), plus "
                "any in unreadable bytes. Consumers past these LSNs must be reset.",
                file=out,
            )
        else:
            print("no intact event is lost (only unreadable bytes and stray copies)", file=out)
        print("cut bytes and moved files are kept as <name>.broken", file=out)
        if not assume_yes:
            out.write("proceed? [y/N] ")
            out.flush()
            answer = sys.stdin.readline().strip().lower()
            if answer not in ("y", "yes"):
                print("aborted; nothing changed", file=out)
                return EXIT_DAMAGED
        _apply(directory, actions)
        after = scan(directory, wal_id)
        if after.damage is not None or after.strays or not after.segments:
            left = _describe_damage(after.damage) if after.damage else "no segment left"
            print(f"repair incomplete: {left}", file=out)
            return EXIT_DAMAGED
        head = after.segments[-1].last_lsn
        print(f"repaired: {len(after.segments)} segment(s), head LSN {head}", file=out)
        return EXIT_OK
    finally:
        os.close(lock_fd)


def _apply(directory: Path, actions: list[_Action]) -> None:
    for a in actions:
        if a.whole:
            target = a.path.with_name(a.path.name + ".broken")
            n = 1
            while target.exists():
                n += 1
                target = a.path.with_name(f"{a.path.name}.broken.{n}")
            os.rename(a.path, target)
        else:
            with a.path.open("rb") as f:
                f.seek(a.offset)
                save_aside(a.path, f.read())
            fd = os.open(a.path, os.O_WRONLY)
            try:
                os.ftruncate(fd, a.offset)
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(directory)


__all__ = ["inspect", "repair", "verify"]
