"""Plan log: durable, checksummed, identity-checked; a torn tail is cut, damage is fatal."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.errors import IdentityMismatchError
from daemon.plane.planlog import PlanLog, PlanLogError


def test_plans_survive_reopen(tmp_path: Path) -> None:
    log = PlanLog(tmp_path / "plans.log", "wal-a", 2)
    assert log.open() == {}
    log.append(1, {0: (1, 5)})
    log.append(2, {0: (6, 6), 1: (2, 9)})
    log.close()

    again = PlanLog(tmp_path / "plans.log", "wal-a", 2)
    assert again.open() == {1: {0: (1, 5)}, 2: {0: (6, 6), 1: (2, 9)}}
    assert again.entries == 2
    again.close()


def test_torn_last_entry_is_cut_and_appends_continue(tmp_path: Path) -> None:
    path = tmp_path / "plans.log"
    log = PlanLog(path, "wal-a", 1)
    log.open()
    log.append(1, {0: (1, 5)})
    log.close()
    with path.open("ab") as f:
        f.write(b'0badc0de {"batch_id":2,"sli')  # crash mid-append

    again = PlanLog(path, "wal-a", 1)
    assert again.open() == {1: {0: (1, 5)}}
    again.append(2, {0: (6, 7)})
    again.close()
    assert PlanLog(path, "wal-a", 1).open() == {1: {0: (1, 5)}, 2: {0: (6, 7)}}


def test_damage_before_the_end_is_fatal(tmp_path: Path) -> None:
    path = tmp_path / "plans.log"
    log = PlanLog(path, "wal-a", 1)
    log.open()
    log.append(1, {0: (1, 5)})
    log.append(2, {0: (6, 9)})
    log.close()
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b"[1,5]", b"[1,6]")
    path.write_bytes(b"".join(lines))

    with pytest.raises(PlanLogError, match="damaged entry"):
        PlanLog(path, "wal-a", 1).open()


def test_plan_log_of_another_wal_refuses_to_start(tmp_path: Path) -> None:
    log = PlanLog(tmp_path / "plans.log", "wal-a", 1)
    log.open()
    log.close()
    with pytest.raises(IdentityMismatchError, match="belongs to WAL wal-a"):
        PlanLog(tmp_path / "plans.log", "wal-b", 1).open()
    with pytest.raises(IdentityMismatchError, match=r"daemon\.cores = 1"):
        PlanLog(tmp_path / "plans.log", "wal-a", 3).open()


def test_rewrite_keeps_only_uncovered_plans(tmp_path: Path) -> None:
    path = tmp_path / "plans.log"
    log = PlanLog(path, "wal-a", 1)
    log.open()
    for b in range(1, 6):
        log.append(b, {0: (b, b)})
    log.rewrite({5: {0: (5, 5)}})
    log.append(6, {0: (6, 6)})
    log.close()
    assert PlanLog(path, "wal-a", 1).open() == {5: {0: (5, 5)}, 6: {0: (6, 6)}}
