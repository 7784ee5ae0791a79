"""`eventplane wal inspect|verify|repair`: inspect and verify report without changing a byte;
repair prints exactly what it will lose, asks, and leaves an openable prefix."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from tests.wal.helpers import OpenWal, events
from tests.wal.test_recovery import fill, flip_bit, last_frames
from wal import Wal, tool
from wal.segments import scan, segment_files


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != "LOCK"}


def test_inspect_prints_segments_lsn_ranges_and_per_core_counts(wal_dir: Path) -> None:
    fill(wal_dir, groups=30, per_group=10, segment_bytes=4096)
    out = io.StringIO()
    assert tool.inspect(wal_dir, out) == 0
    text = out.getvalue()
    wal_id = (wal_dir / "IDENTITY").read_text().strip()
    assert wal_id in text
    assert "LSN 1..300" in text
    for path in segment_files(wal_dir):
        assert path.name in text
    assert "events by core: 0:90 1:90 2:60 3:60 (total 300)" in text


def test_verify_passes_a_clean_wal_and_changes_nothing(wal_dir: Path) -> None:
    fill(wal_dir, groups=30, segment_bytes=4096)
    before = snapshot(wal_dir)
    out = io.StringIO()
    assert tool.verify(wal_dir, out, progress=False) == 0
    assert out.getvalue().rstrip().endswith("OK")
    assert "30 frame(s), 270 event(s)" in out.getvalue()
    assert snapshot(wal_dir) == before


def test_verify_draws_a_progress_bar_when_asked(
    wal_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(wal_dir, groups=30, segment_bytes=4096)
    assert tool.verify(wal_dir, io.StringIO(), progress=True) == 0
    assert "100%" in capsys.readouterr().err


def test_verify_reports_damage_with_segment_and_offset(wal_dir: Path) -> None:
    fill(wal_dir, groups=60, segment_bytes=4096)
    first = segment_files(wal_dir)[0]
    offset = scan(wal_dir, None).segments[0].frame_offsets[2]
    flip_bit(first, offset + 45)
    before = snapshot(wal_dir)
    out = io.StringIO()
    assert tool.verify(wal_dir, out, progress=False) == 1
    assert f"DAMAGE: {first.name} @ byte offset {offset}: frame CRC mismatch" in out.getvalue()
    assert snapshot(wal_dir) == before


def test_verify_calls_a_torn_tail_harmless(wal_dir: Path) -> None:
    fill(wal_dir, groups=5)
    seg, offsets, end = last_frames(wal_dir)
    with seg.open("r+b") as f:
        f.truncate(end - 3)
    out = io.StringIO()
    assert tool.verify(wal_dir, out, progress=False) == 0
    assert f"torn tail: {seg.name} @ byte offset {offsets[-1]}" in out.getvalue()


def test_missing_wal_is_reported_with_exit_code_2(tmp_path: Path) -> None:
    out = io.StringIO()
    assert tool.verify(tmp_path / "nowhere", out, progress=False) == 2
    assert tool.inspect(tmp_path, out) == 2
    assert "no WAL" in out.getvalue()


def test_repair_prints_the_loss_and_changes_nothing_when_declined(
    wal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(wal_dir, groups=60, per_group=10, segment_bytes=4096)
    files = segment_files(wal_dir)
    seg1 = scan(wal_dir, None).segments[1]
    flip_bit(files[1], seg1.frame_offsets[1] + 33)
    before = snapshot(wal_dir)
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    out = io.StringIO()
    assert tool.repair(wal_dir, out, assume_yes=False) == 1
    text = out.getvalue()
    lost_from = seg1.frame_lsns[1]
    assert f"{files[1].name}: cut bytes {seg1.frame_offsets[1]}.." in text
    assert f"events LOST: LSN {lost_from}..600" in text
    for later in files[2:]:
        assert f"{later.name}: move aside the whole file" in text
    assert "proceed? [y/N]" in text and "aborted; nothing changed" in text
    assert snapshot(wal_dir) == before


def test_repair_cuts_at_the_first_bad_frame_and_the_wal_opens_again(wal_dir: Path) -> None:
    records = fill(wal_dir, groups=60, per_group=10, segment_bytes=4096)
    files = segment_files(wal_dir)
    seg1 = scan(wal_dir, None).segments[1]
    flip_bit(files[1], seg1.frame_offsets[1] + 33)
    out = io.StringIO()
    assert tool.repair(wal_dir, out, assume_yes=True) == 0
    assert "repaired: 2 segment(s)" in out.getvalue()
    keep = seg1.frame_lsns[1] - 1
    with Wal.open(wal_dir) as wal:
        assert list(wal.read(1)) == records[:keep]
        assert wal.append_blocking(events(1))[0] == keep + 1
    assert (wal_dir / (files[1].name + ".broken")).exists()
    assert all((wal_dir / (f.name + ".broken")).exists() for f in files[2:])


def test_repair_moves_a_duplicated_segment_aside_without_losing_events(wal_dir: Path) -> None:
    records = fill(wal_dir, groups=60, segment_bytes=4096)
    files = segment_files(wal_dir)
    copy = wal_dir / "00000000000000999999.wal"
    shutil.copyfile(files[1], copy)
    out = io.StringIO()
    assert tool.repair(wal_dir, out, assume_yes=True) == 0
    assert "no intact event is lost" in out.getvalue()
    with Wal.open(wal_dir) as wal:
        assert list(wal.read(1)) == records


def test_repair_refuses_while_the_wal_is_open(open_wal: OpenWal, wal_dir: Path) -> None:
    open_wal().append_blocking(events(3))
    out = io.StringIO()
    assert tool.repair(wal_dir, out, assume_yes=True) == 1
    assert "refusing to repair" in out.getvalue() and "in use" in out.getvalue()


def test_repair_of_an_intact_wal_does_nothing(wal_dir: Path) -> None:
    fill(wal_dir, groups=3)
    before = snapshot(wal_dir)
    out = io.StringIO()
    assert tool.repair(wal_dir, out, assume_yes=True) == 0
    assert "nothing to repair" in out.getvalue()
    assert snapshot(wal_dir) == before
