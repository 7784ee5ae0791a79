"""Retention deletes only whole sealed segments below a floor; reading below the floor raises
BelowRetainedFloorError naming both LSNs; the floor survives a reopen."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.wal.helpers import OpenWal, events
from wal import BelowRetainedFloorError
from wal.segments import segment_files


def test_truncate_below_removes_only_sealed_segments_wholly_below_the_lsn(
    open_wal: OpenWal, wal_dir: Path
) -> None:
    wal = open_wal(segment_bytes=4096)
    for k in range(60):
        wal.append_blocking(events(10, tag=str(k)))
    before = segment_files(wal_dir)
    firsts = [int(p.name[:20]) for p in before]
    assert len(before) >= 4
    # An LSN inside segment 3: segments 1 and 2 go, segment 3 stays.
    removed = wal.truncate_below(firsts[2] + 1)
    assert removed == 2
    assert segment_files(wal_dir) == before[2:]
    assert wal.retained_floor() == firsts[2]
    assert wal.segment_count() == len(before) - 2
    assert [r.lsn for r in wal.read(firsts[2])] == list(range(firsts[2], 601))
    with pytest.raises(BelowRetainedFloorError) as info:
        wal.read(firsts[2] - 1)
    assert (info.value.requested_lsn, info.value.floor_lsn) == (firsts[2] - 1, firsts[2])
    assert str(firsts[2]) in str(info.value) and str(firsts[2] - 1) in str(info.value)


def test_truncate_never_removes_the_active_segment(open_wal: OpenWal) -> None:
    wal = open_wal(segment_bytes=4096)
    for k in range(30):
        wal.append_blocking(events(10, tag=str(k)))
    count = wal.segment_count()
    assert wal.truncate_below(10**9) == count - 1
    assert wal.segment_count() == 1
    floor = wal.retained_floor()
    assert [r.lsn for r in wal.read(floor)] == list(range(floor, 301))
    first, _ = wal.append_blocking([(0, b"more")])
    assert first == 301


def test_floor_and_numbering_survive_reopen_after_retention(open_wal: OpenWal) -> None:
    wal = open_wal(segment_bytes=4096)
    for k in range(60):
        wal.append_blocking(events(10, tag=str(k)))
    wal.truncate_below(300)
    floor = wal.retained_floor()
    wal.close()
    wal = open_wal(segment_bytes=4096)
    assert wal.retained_floor() == floor
    for k in range(30):
        wal.append_blocking(events(10, tag=f"again{k}"))
    assert [r.lsn for r in wal.read(floor)] == list(range(floor, 901))
    with pytest.raises(BelowRetainedFloorError):
        wal.read(1)
