"""Recovery on open: a torn tail of the last segment is cut back to whole frames (bytes kept
as .broken); damage anywhere else, or missing / duplicated / misplaced segments, refuse to open
with the segment, the offset and what was wrong."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.wal.helpers import OpenWal, events
from wal import Record, Wal, WalCorruptionError
from wal.format import SEGMENT_HEADER_SIZE, encode_segment_header, segment_name
from wal.segments import scan, segment_files


def fill(
    directory: Path, groups: int, per_group: int = 9, segment_bytes: int = 64 * 1024
) -> list[Record]:
    """A closed WAL with ``groups`` frames; returns every record."""
    with Wal.open(directory, segment_bytes=segment_bytes) as wal:
        for k in range(groups):
            wal.append_blocking(events(per_group, tag=f"g{k}"))
        return list(wal.read(1))


def last_frames(directory: Path) -> tuple[Path, list[int], int]:
    """(last segment, offsets of its frames, its end)."""
    seg = scan(directory, None).segments[-1]
    return seg.path, list(seg.frame_offsets), seg.end


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def assert_recovers_to(directory: Path, expected: list[Record]) -> None:
    """Opening keeps exactly ``expected`` and appends continue right after it."""
    with Wal.open(directory, segment_bytes=64 * 1024) as wal:
        assert list(wal.read(1)) == expected
        assert wal.head_lsn() == len(expected)
        first, _ = wal.append_blocking([(1, b"next")])
        assert first == len(expected) + 1
        assert list(wal.read(first)) == [Record(first, 1, 1, b"next")]


def test_torn_tail_at_every_byte_of_the_last_two_frames_recovers_the_whole_frames_before(
    tmp_path: Path,
) -> None:
    """1. Write 6 frames and keep a pristine copy.
    2. For every byte offset inside the last two frames: restore the copy, cut the last
       segment there, open.
    3. The log is exactly the frames wholly before the cut; appends continue.
    """
    pristine = tmp_path / "pristine"
    records = fill(pristine, groups=6, per_group=5)
    seg_path, offsets, end = last_frames(pristine)
    per_frame = 5
    work = tmp_path / "work"
    cut_points = range(offsets[-2], end)
    for cut in cut_points:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        target = work / seg_path.name
        os.truncate(target, cut)
        whole = sum(1 for frame_end in [*offsets[1:], end] if frame_end <= cut)
        with capture_logs() as logs, Wal.open(work) as wal:
            assert list(wal.read(1)) == records[: whole * per_frame]
        torn_at = max(off for off in offsets if off <= cut)
        cut_events = [e for e in logs if e["event"] == "wal.torn_tail_cut"]
        if cut == torn_at:  # exactly on a frame boundary: nothing torn, nothing logged
            assert cut_events == []
            continue
        (event,) = cut_events
        assert event["segment"] == seg_path.name and event["offset"] == torn_at
        assert (work / (seg_path.name + ".broken")).read_bytes() == (
            (pristine / seg_path.name).read_bytes()[torn_at:cut]
        )
    assert len(cut_points) > 100
    assert_recovers_to(work, records[: 5 * per_frame])  # the last cut was one byte short


def test_zeroed_sector_in_the_last_frame_is_cut_as_a_torn_tail(wal_dir: Path) -> None:
    records = fill(wal_dir, groups=4, per_group=200)
    seg_path, offsets, end = last_frames(wal_dir)
    sector = (offsets[-1] // 512 + 1) * 512  # the first whole 512-byte sector of the frame
    assert sector + 512 < end
    with seg_path.open("r+b") as f:
        f.seek(sector)
        f.write(b"\0" * 512)
    assert_recovers_to(wal_dir, records[:600])


def test_garbage_after_the_last_frame_is_cut_and_kept_aside(wal_dir: Path) -> None:
    records = fill(wal_dir, groups=3)
    seg_path, _offsets, end = last_frames(wal_dir)
    garbage = os.urandom(3000)
    with seg_path.open("ab") as f:
        f.write(garbage)
    assert_recovers_to(wal_dir, records)
    assert (wal_dir / (seg_path.name + ".broken")).read_bytes() == garbage
    assert seg_path.stat().st_size > end  # the appended record went where the garbage was


def test_bit_flip_in_a_sealed_segment_refuses_to_open_naming_segment_and_offset(
    wal_dir: Path,
) -> None:
    fill(wal_dir, groups=100, segment_bytes=4096)
    first = segment_files(wal_dir)[0]
    offsets = list(scan(wal_dir, None).segments[0].frame_offsets)
    flip_bit(first, offsets[1] + 40)
    with pytest.raises(WalCorruptionError, match="CRC mismatch") as info:
        Wal.open(wal_dir)
    assert info.value.segment == first.name
    assert info.value.offset == offsets[1]
    assert "not a torn tail" in str(info.value) and "wal repair" in str(info.value)


def test_damage_followed_by_intact_frames_in_the_last_segment_is_not_a_torn_tail(
    wal_dir: Path,
) -> None:
    fill(wal_dir, groups=5)
    seg_path, offsets, _end = last_frames(wal_dir)
    flip_bit(seg_path, offsets[2] + 50)
    with pytest.raises(WalCorruptionError, match="not a torn tail") as info:
        Wal.open(wal_dir)
    assert info.value.offset == offsets[2]


def test_missing_segment_refuses_to_open(wal_dir: Path) -> None:
    fill(wal_dir, groups=100, segment_bytes=4096)
    files = segment_files(wal_dir)
    assert len(files) >= 4
    files[2].unlink()
    with pytest.raises(WalCorruptionError, match=r"segment\(s\) 3\.\.3 missing"):
        Wal.open(wal_dir)


def test_duplicated_segment_refuses_to_open(wal_dir: Path) -> None:
    fill(wal_dir, groups=100, segment_bytes=4096)
    files = segment_files(wal_dir)
    copy = wal_dir / segment_name(int(files[-1].name[:20]) + 1_000)
    shutil.copyfile(files[1], copy)
    with pytest.raises(WalCorruptionError, match="duplicated segment") as info:
        Wal.open(wal_dir)
    assert info.value.segment == copy.name
    assert files[1].name in str(info.value)


def test_segment_numbers_out_of_order_refuse_to_open(wal_dir: Path) -> None:
    fill(wal_dir, groups=100, segment_bytes=4096)
    files = segment_files(wal_dir)
    wal_id = bytes.fromhex((wal_dir / "IDENTITY").read_text().strip())
    # Rewrite segment 3's header to claim number 7 (and a valid CRC): only the order is wrong.
    data = bytearray(files[2].read_bytes())
    data[:SEGMENT_HEADER_SIZE] = encode_segment_header(wal_id, 7, int(files[2].name[:20]))
    files[2].write_bytes(bytes(data))
    with pytest.raises(WalCorruptionError, match=r"missing between|out of order"):
        Wal.open(wal_dir)


def test_segment_of_another_wal_refuses_to_open(wal_dir: Path, tmp_path: Path) -> None:
    fill(wal_dir, groups=3)
    other = tmp_path / "other"
    fill(other, groups=3)
    (wal_dir / "IDENTITY").write_text((other / "IDENTITY").read_text())
    with pytest.raises(WalCorruptionError, match="belongs to WAL"):
        Wal.open(wal_dir)


def test_segments_without_identity_refuse_to_open(wal_dir: Path) -> None:
    fill(wal_dir, groups=3)
    (wal_dir / "IDENTITY").unlink()
    with pytest.raises(WalCorruptionError, match="no IDENTITY"):
        Wal.open(wal_dir)


def test_identity_without_segments_refuses_to_open(wal_dir: Path) -> None:
    fill(wal_dir, groups=3)
    for path in segment_files(wal_dir):
        path.unlink()
    with pytest.raises(WalCorruptionError, match="no segment file"):
        Wal.open(wal_dir)


def test_crash_while_creating_a_segment_drops_the_header_only_file(wal_dir: Path) -> None:
    records = fill(wal_dir, groups=3)
    files = segment_files(wal_dir)
    torn = wal_dir / segment_name(len(records) + 1)
    torn.write_bytes(encode_segment_header(b"\0" * 16, len(files) + 1, len(records) + 1)[:20])
    assert_recovers_to(wal_dir, records)
    assert not torn.exists() or torn.stat().st_size > SEGMENT_HEADER_SIZE
    assert (wal_dir / (torn.name + ".broken")).exists()


def test_new_wal_interrupted_before_identity_starts_over(wal_dir: Path) -> None:
    wal_dir.mkdir()
    (wal_dir / segment_name(1)).write_bytes(b"\0" * 10)
    with Wal.open(wal_dir) as wal:
        assert wal.head_lsn() == 0
        assert wal.append_blocking([(0, b"x")]) == (1, 1)


def test_reopening_with_a_smaller_segment_size_rotates_on_the_next_append(
    open_wal: OpenWal,
) -> None:
    wal = open_wal(segment_bytes=1 << 20)
    wal.append_blocking(events(500))
    wal.close()
    wal = open_wal(segment_bytes=4096)
    wal.append_blocking(events(5))
    assert wal.segment_count() == 2
    assert [r.lsn for r in wal.read(1)] == list(range(1, 506))
