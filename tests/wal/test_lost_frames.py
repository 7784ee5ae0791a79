"""Lost frames (wal/format.py, ``FLAG_LOST``): LSNs a restore found in tables
but not in the archive. The WAL keeps its LSNs contiguous over them, no reader
sees an event there, new events go on above them, and they travel through the
archive's objects byte for byte."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest

from tests.wal.helpers import OpenWal, events
from wal import Wal
from wal.archive import encode_object, parse_object
from wal.format import (
    FRAME_HEADER_SIZE,
    check_frame,
    encode_lost_frame,
    parse_segment_header,
)
from wal.segments import segment_files
from wal.tool import inspect, verify


def _append_lost(wal_dir: Path, first_lsn: int, count: int) -> bytes:
    """What a restore does: the lost frame at the end of the last segment."""
    path = segment_files(wal_dir)[-1]
    head = parse_segment_header(path.read_bytes()[:64])
    assert not isinstance(head, str)
    frame = encode_lost_frame(head.number, first_lsn, count)
    with path.open("ab") as f:
        f.write(frame)
    return frame


def _filled(open_wal: OpenWal, n: int) -> int:
    wal = open_wal()
    wal.append_blocking(events(n))
    head = wal.head_lsn()
    wal.close()
    return head


def _around_lost(
    open_wal: OpenWal, wal_dir: Path, before: int, lost: int, after: int
) -> tuple[Wal, int]:
    """``before`` events, a lost frame of ``lost`` LSNs, reopened, ``after``
    events: the open WAL and its head before the lost frame."""
    head = _filled(open_wal, before)
    _append_lost(wal_dir, head + 1, lost)
    wal = open_wal()
    wal.append_blocking(events(after))
    return wal, head


def test_a_lost_frame_moves_the_head_and_readers_see_no_event_in_it(
    open_wal: OpenWal, wal_dir: Path
) -> None:
    head = _filled(open_wal, 12)
    _append_lost(wal_dir, head + 1, 1000)
    wal = open_wal()
    assert wal.head_lsn() == head + 1000
    assert wal.lost_ranges() == [(head + 1, head + 1000)]
    first, last = wal.append_blocking(events(8, tag="after"))
    assert (first, last) == (head + 1001, head + 1008)
    every = list(wal.read(1))
    assert [r.lsn for r in every] == [*range(1, head + 1), *range(first, last + 1)]
    for core in range(4):
        mine = [r.lsn for r in wal.read(1, core=core)]
        assert mine == [r.lsn for r in every if r.core == core]
        batches = [lsn for b in wal.read_batches(head - 2, core=core) for lsn in b.lsns]
        assert batches == [lsn for lsn in mine if lsn >= head - 2]
    # A read that starts and ends inside the lost range finds nothing, and no error.
    assert list(wal.read(head + 10, to_lsn=head + 20)) == []
    raw = wal.read_frames(head + 1)
    assert raw[0][:2] == (head + 1, 1000) and len(raw[0][2]) == FRAME_HEADER_SIZE


def test_a_reopened_wal_keeps_its_lost_range_and_verify_names_it(
    open_wal: OpenWal, wal_dir: Path
) -> None:
    wal, head = _around_lost(open_wal, wal_dir, 5, 7, 3)
    wal.close()
    wal = open_wal()
    assert wal.lost_ranges() == [(head + 1, head + 7)] and wal.head_lsn() == head + 10
    wal.close()
    for tool in (verify, inspect):
        out = io.StringIO()
        args = (wal_dir, out, False) if tool is verify else (wal_dir, out)
        assert tool(*args) == 0, out.getvalue()  # type: ignore[operator]
        assert f"LOST: LSN {head + 1}..{head + 7} hold no event" in out.getvalue()


def test_a_bit_flip_in_a_lost_frame_is_damage_not_a_shorter_wal(
    open_wal: OpenWal, wal_dir: Path
) -> None:
    wal, head = _around_lost(open_wal, wal_dir, 5, 7, 3)  # acknowledged events after it
    wal.close()
    path = segment_files(wal_dir)[-1]
    data = bytearray(path.read_bytes())
    at = data.find(encode_lost_frame(1, head + 1, 7))
    assert at > 0
    data[at + 20] ^= 0x01  # the count
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match="CRC mismatch"):
        Wal.open(wal_dir)


@pytest.mark.parametrize("seed", range(20))
def test_a_malformed_lost_frame_is_refused_with_its_reason(seed: int) -> None:
    rng = random.Random(seed)
    first, count = rng.randrange(1, 1 << 40), rng.randrange(1, 1 << 32)
    good = encode_lost_frame(3, first, count)
    frame = check_frame(good, 0, len(good), 3)
    assert not isinstance(frame, str) and frame.lost
    assert (frame.first_lsn, frame.events, frame.sections) == (first, count, [])
    assert check_frame(good, 0, len(good), 4) == (
        "frame carries segment stamp 3, this is segment 4 (stale bytes)"
    )
    cut = rng.randrange(1, len(good))
    assert "truncated frame header" in str(check_frame(good[:cut], 0, cut, 3))
    flipped = bytearray(good)
    flipped[rng.randrange(8, len(good))] ^= 1 << rng.randrange(8)
    assert isinstance(check_frame(bytes(flipped), 0, len(good), 3), str)


def test_a_lost_frame_of_no_lsn_cannot_be_made() -> None:
    with pytest.raises(Exception, match="1 to 4294967295 LSNs, not 0"):
        encode_lost_frame(1, 5, 0)


def test_an_archive_object_carries_a_lost_frame_with_its_neighbours(
    open_wal: OpenWal, wal_dir: Path
) -> None:
    wal, head = _around_lost(open_wal, wal_dir, 6, 50, 4)
    frames = wal.read_frames(1)
    body = b"".join(encode_object(wal.wal_id, 1, 1, 1, wal.head_lsn(), [f[2] for f in frames]))
    got_head, got = parse_object(body)
    assert (got_head.first_lsn, got_head.last_lsn) == (1, head + 54)
    assert got == frames
    assert (head + 1, 50) in [(f[0], f[1]) for f in got]
