"""Watermarks file: atomic replace, identity checks (invariant 13), damage detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.errors import IdentityMismatchError, LsnRegressionError
from daemon.plane.batch import MicroBatch, Slice
from daemon.plane.watermarks import (
    Pause,
    WatermarkFileError,
    Watermarks,
    WatermarkSnapshot,
    WatermarkStore,
)
from tests.core.conftest import rec


def test_missing_file_means_every_core_starts_at_zero(tmp_path: Path) -> None:
    snap = WatermarkStore(tmp_path / "w.json").load("wal-a", 3)
    assert snap == WatermarkSnapshot("wal-a", 3, 0, (0, 0, 0))


def test_saved_watermarks_load_back_and_leave_no_temp_file(tmp_path: Path) -> None:
    store = WatermarkStore(tmp_path / "w.json")
    store.save(WatermarkSnapshot("wal-a", 2, 7, (40, 39)))

    assert store.load("wal-a", 2) == WatermarkSnapshot("wal-a", 2, 7, (40, 39))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.json"]


def test_other_wal_id_refuses_to_start_and_says_what_to_do(tmp_path: Path) -> None:
    store = WatermarkStore(tmp_path / "w.json")
    store.save(WatermarkSnapshot("wal-a", 2, 7, (40, 39)))

    with pytest.raises(IdentityMismatchError) as info:
        store.load("wal-b", 2, plans_path=tmp_path / "plans.log")
    message = str(info.value)
    assert "belongs to WAL wal-a" in message
    assert "has id wal-b" in message
    assert "move" in message and "plans.log" in message


def test_other_core_count_refuses_to_start_and_says_what_to_do(tmp_path: Path) -> None:
    store = WatermarkStore(tmp_path / "w.json")
    store.save(WatermarkSnapshot("wal-a", 2, 7, (40, 39)))

    with pytest.raises(IdentityMismatchError, match=r"daemon.cores = 2.*now says 4.*new data_dir"):
        store.load("wal-a", 4)


def test_damaged_file_is_refused_not_read_as_zero(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    WatermarkStore(path).save(WatermarkSnapshot("wal-a", 2, 7, (40, 39)))
    doc = json.loads(path.read_text())
    doc["lsns"] = [400, 39]  # a flipped digit
    path.write_text(json.dumps(doc))

    with pytest.raises(WatermarkFileError, match="checksum mismatch"):
        WatermarkStore(path).load("wal-a", 2)


def test_commit_moves_only_the_batch_cores_and_marks_dirty() -> None:
    wm = Watermarks(WatermarkSnapshot("w", 3, 0, (0, 0, 0)))
    assert not wm.dirty
    wm.commit(MicroBatch(1, {1: Slice(1, 2, 5, [rec(2, 1), rec(5, 1)])}))

    assert wm.lsns == [0, 5, 0]
    assert wm.batch_id == 1
    assert wm.dirty


def test_commit_refuses_to_move_a_watermark_back() -> None:
    wm = Watermarks(WatermarkSnapshot("w", 1, 3, (10,)))
    with pytest.raises(LsnRegressionError, match="back from LSN 10 to 9"):
        wm.commit(MicroBatch(4, {0: Slice(0, 9, 9, [rec(9)])}))


def test_heartbeat_advance_never_moves_back() -> None:
    wm = Watermarks(WatermarkSnapshot("w", 1, 0, (10,)))
    assert not wm.advance(0, 5)
    assert wm.advance(0, 12)
    assert wm.lsns == [12]


def test_stage_progress_is_saved_and_loaded_with_the_watermarks(tmp_path: Path) -> None:
    store = WatermarkStore(tmp_path / "w.json")
    snap = WatermarkSnapshot("wal-a", 2, 7, (40, 39), (("cdc:all", 9), ("triggers", 7)))
    store.save(snap)

    loaded = store.load("wal-a", 2)
    assert loaded == snap
    assert Watermarks(loaded).stages == {"cdc:all": 9, "triggers": 7}


def test_version_1_file_without_stages_still_loads(tmp_path: Path) -> None:
    """Files written before per-stage progress: every stage starts at batch_id."""
    import zlib

    path = tmp_path / "w.json"
    body = {"format": "eventplane-watermarks", "version": 1, "wal_id": "wal-a", "cores": 2,
            "batch_id": 7, "lsns": [40, 39]}  # fmt: skip
    crc = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    path.write_text(json.dumps({**body, "crc32": crc}))

    loaded = WatermarkStore(path).load("wal-a", 2)
    assert loaded == WatermarkSnapshot("wal-a", 2, 7, (40, 39))
    assert Watermarks(loaded).stages == {}


def test_a_stage_commits_batches_in_id_order_only() -> None:
    wm = Watermarks(WatermarkSnapshot("w", 1, 3, (10,)))
    wm.stage_done("cdc:all", 4)
    with pytest.raises(LsnRegressionError, match="stage 'cdc:all' committed batch 4 after batch 4"):
        wm.stage_done("cdc:all", 4)
    assert wm.dirty


def test_pauses_are_saved_as_version_3_and_a_file_without_one_stays_version_2(
    tmp_path: Path,
) -> None:
    """A file without a paused stage is what the release before pausing wrote
    (version 2), so going back to it works while nothing is paused."""
    store = WatermarkStore(tmp_path / "w.json")
    pause = Pause(1740830400.5, "ops@host", "receiver maintenance")
    snap = WatermarkSnapshot("wal-a", 2, 7, (40, 39), (("cdc:all", 9),), (("triggers", pause),))
    store.save(snap)
    doc = json.loads(store.path.read_text())
    assert doc["version"] == 3
    assert doc["paused"] == {
        "triggers": {"since": 1740830400.5, "by": "ops@host", "reason": "receiver maintenance"}
    }
    loaded = store.load("wal-a", 2)
    assert loaded == snap and Watermarks(loaded).paused == {"triggers": pause}

    wm = Watermarks(loaded)
    del wm.paused["triggers"]
    assert wm.dirty
    store.save(wm.snapshot())
    doc = json.loads(store.path.read_text())
    assert doc["version"] == 2 and "paused" not in doc
    assert store.load("wal-a", 2).paused == ()


def test_a_damaged_pause_record_is_refused_not_dropped(tmp_path: Path) -> None:
    import zlib

    path = tmp_path / "w.json"
    body = {"format": "eventplane-watermarks", "version": 3, "wal_id": "wal-a", "cores": 1,
            "batch_id": 7, "lsns": [40], "stages": {},
            "paused": {"cdc:all": {"by": "x"}}}  # fmt: skip
    crc = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    path.write_text(json.dumps({**body, "crc32": crc}))
    with pytest.raises(WatermarkFileError, match="not a valid watermarks file"):
        WatermarkStore(path).load("wal-a", 1)
