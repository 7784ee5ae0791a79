"""The table generation (daemon/table/snapshot.py): how a reader gets a list of files
that no compaction swap or retention removal cut through. Real files; the
clock, the sleep and the lister are injected so no test waits for real."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.errors import DaemonError
from daemon.table import snapshot
from daemon.table.snapshot import (
    SnapshotError,
    TableBusyError,
    consistent,
    data_files,
    open_generation,
    read_generation,
    table_change,
)


@pytest.fixture
def table(tmp_path: Path) -> Path:
    root = tmp_path / "all"
    for rel in (
        "collection=orders/part-b000000000001-a.parquet",
        "collection=orders/part-b000000000002-a.parquet",
        "collection=users/date=2026-11-27/part-b000000000001-a.parquet",
        "collection=users/.part-b000000000003-a.parquet.tmp",  # a writer's temp file
        "collection=users/_common_metadata",
        "_common_metadata",
        "_eventplane/ledger.json",
        ".expired-x/part-b000000000001-a.parquet",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    return root


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def write_lock_holder(root: Path, pid: int) -> None:
    record = {"pid": pid, "host": socket.gethostname(), "since": "2026-11-27T00:00:00Z"}
    (root / "_eventplane" / "lock").write_text(json.dumps(record) + "\n")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_data_files_are_what_readers_count_and_nothing_hidden(table: Path) -> None:
    files = [os.path.relpath(f, table) for f in data_files(table)]
    assert files == [
        "collection=orders/part-b000000000001-a.parquet",
        "collection=orders/part-b000000000002-a.parquet",
        "collection=users/date=2026-11-27/part-b000000000001-a.parquet",
    ]


def test_a_quiet_table_is_listed_once(table: Path) -> None:
    snap = snapshot.snapshot(table)
    assert snap.attempts == 1 and snap.generation == 0
    assert snap.files == data_files(table)


def test_a_change_is_odd_while_it_runs_and_even_after_even_when_it_fails(table: Path) -> None:
    assert read_generation(table) == 0
    with table_change(table):
        assert read_generation(table) == 1
    assert read_generation(table) == 2
    with pytest.raises(RuntimeError), table_change(table):
        assert read_generation(table) == 3
        raise RuntimeError("the swap failed")
    assert read_generation(table) == 4


def test_opening_a_stream_ends_an_odd_generation_and_always_moves_it(table: Path) -> None:
    assert open_generation(table) == 2
    assert open_generation(table) == 4
    (table / "_eventplane" / "generation").write_text("7\n")  # killed mid-change
    assert open_generation(table) == 8


def test_a_change_during_the_listing_makes_the_reader_list_again(table: Path) -> None:
    """1. The first listing is taken.  2. A change (here a removal, bracketed by
    the generation as compaction and retention do) lands before the reader
    reads the generation again.  3. The reader lists again and returns the
    second listing, which does not name the removed file."""
    removed = table / "collection=orders" / "part-b000000000001-a.parquet"
    calls: list[list[str]] = []

    def lister(root: Path) -> list[str]:
        files = data_files(root)
        calls.append(files)
        if len(calls) == 1:
            with table_change(root):
                removed.unlink()
        return files

    snap = snapshot.snapshot(table, lister=lister)
    assert snap.attempts == 2
    assert str(removed) in calls[0] and str(removed) not in snap.files
    assert snap.files == data_files(table) and snap.generation == 2


def test_an_odd_generation_is_waited_out(table: Path) -> None:
    (table / "_eventplane" / "generation").write_text("5\n")
    clock = FakeClock()

    def sleep(s: float) -> None:
        clock.sleep(s)
        if len(clock.slept) == 3:  # the writer finishes its change
            (table / "_eventplane" / "generation").write_text("6\n")

    snap = snapshot.snapshot(table, clock=clock, sleep=sleep)
    assert snap.generation == 6 and snap.attempts == 1
    assert len(clock.slept) == 3


def test_an_odd_generation_whose_writer_is_gone_does_not_block_readers(table: Path) -> None:
    (table / "_eventplane" / "generation").write_text("5\n")
    write_lock_holder(table, dead_pid())
    clock = FakeClock()
    snap = snapshot.snapshot(table, wait_s=2.0, clock=clock, sleep=clock.sleep)
    assert snap.generation == 5 and snap.files == data_files(table)
    assert clock.now >= 2.0


def test_an_odd_generation_whose_writer_runs_is_a_clear_busy_error(table: Path) -> None:
    (table / "_eventplane" / "generation").write_text("5\n")
    write_lock_holder(table, os.getpid())
    clock = FakeClock()
    with pytest.raises(TableBusyError, match=r"generation .*generation = 5\) odd for 2\.\d s"):
        snapshot.snapshot(table, wait_s=2.0, clock=clock, sleep=clock.sleep)


def test_a_table_that_never_stops_changing_is_an_error_not_a_hang(table: Path) -> None:
    def lister(root: Path) -> list[str]:
        with table_change(root):
            pass
        return data_files(root)

    with pytest.raises(SnapshotError, match="changed during each of 100 listings"):
        snapshot.snapshot(table, lister=lister)


def test_a_damaged_generation_file_says_what_to_do(table: Path) -> None:
    (table / "_eventplane" / "generation").write_text("garbage")
    with pytest.raises(SnapshotError, match="Remove it") as err:
        snapshot.snapshot(table)
    assert isinstance(err.value, DaemonError)  # one family: ``except DaemonError`` catches it
    assert issubclass(TableBusyError, DaemonError)


def test_a_missing_table_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        snapshot.snapshot(tmp_path / "nope")


def test_a_read_that_a_change_cuts_through_runs_again(table: Path) -> None:
    results: list[int] = []

    def build() -> int:
        results.append(len(data_files(table)))
        if len(results) == 1:
            with table_change(table):
                (table / "collection=orders" / "part-b000000000001-a.parquet").unlink()
        return results[-1]

    assert consistent(table, build) == 2
    assert results == [3, 2]


def test_a_read_that_fails_because_a_change_removed_its_file_runs_again(table: Path) -> None:
    attempts: list[int] = []

    def build() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            with table_change(table):
                pass
            raise FileNotFoundError("a merged-away input")
        return "rows"

    assert consistent(table, build) == "rows" and len(attempts) == 2


def test_a_read_that_fails_on_its_own_raises_at_once(table: Path) -> None:
    attempts: list[int] = []

    def build() -> str:
        attempts.append(1)
        raise ValueError("a bad query")

    with pytest.raises(ValueError, match="a bad query"):
        consistent(table, build)
    assert len(attempts) == 1
