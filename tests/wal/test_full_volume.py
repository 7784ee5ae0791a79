"""A write that finds the volume full (ENOSPC, EDQUOT) fails only its own group with the
retriable WalFullError: the partial frame is cut, its LSNs and sequences are given back, and
the WAL takes the next append as usual. Fatal failures (fsync, EIO, a failed rollback):
test_fsync_failure.py."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from structlog.testing import capture_logs

from tests.faults.support import tmpfs
from tests.wal.helpers import OpenWal, events, failing_once
from wal import Record, Wal, WalError, WalFullError
from wal.format import SEGMENT_HEADER_SIZE

REAL_PWRITEV = os.pwritev
REAL_PWRITE = os.pwrite
REAL_OPEN = os.open
REAL_WRITE = os.write


def segment_sizes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(directory.glob("*.wal"))}


@contextlib.contextmanager
def volume_fills_mid_frame(error: int) -> Iterator[None]:
    """The next frame write gets half its bytes onto the disk, then ``error``.

    The first pwritev really writes half the frame and reports a short write
    (as a filling volume does); the writer's pwrite of the rest fails.
    """
    calls = []

    def short_pwritev(fd: int, parts: list[Any], offset: int) -> int:
        calls.append(offset)
        if len(calls) > 1:
            return REAL_PWRITEV(fd, parts, offset)
        data = b"".join(bytes(p) for p in parts)
        return REAL_PWRITE(fd, data[: len(data) // 2], offset)

    with (
        mock.patch.object(os, "pwritev", side_effect=short_pwritev),
        mock.patch.object(os, "pwrite", side_effect=failing_once(REAL_PWRITE, error)),
    ):
        yield
    assert calls, "no frame was written"


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EDQUOT], ids=errno.errorcode.get)
def test_a_group_write_that_finds_the_volume_full_is_undone_and_its_lsns_reused(
    open_wal: OpenWal, wal_dir: Path, error: int
) -> None:
    """1. Two appends are acknowledged (LSNs 1-3, core 0 seqs 1-2, core 1 seq 1).
    2. The next frame gets half-written, then the volume is full: that append raises
       WalFullError (retriable, its cause the OSError) and nothing of it remains: the
       segment is back to its size, head, records, listener and on_group unchanged.
    3. Space returns: the next append gets LSN 4 and the sequences the failed one had.
    4. Reopen: exactly the acknowledged records, and no torn tail to cut.
    """
    wal = open_wal()
    heard: list[list[Record]] = []
    groups: list[int] = []
    wal.set_listener(heard.append)
    wal.on_group = lambda n, size, seconds: groups.append(n)
    assert wal.append_blocking([(0, b"a"), (1, b"b")]) == (1, 2)
    assert wal.append_blocking([(0, b"c")]) == (3, 3)
    acked = list(wal.read(1))
    sizes = segment_sizes(wal_dir)

    with volume_fills_mid_frame(error), pytest.raises(WalFullError) as info:
        wal.append_blocking([(1, b"lost" * 100), (0, b"lost too")])
    err = info.value
    assert isinstance(err, WalError) and err.retriable and WalFullError.retriable
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == error
    assert err.directory == str(wal_dir)
    assert err.nbytes > 400 and err.free_bytes is not None and err.free_bytes > 0
    message = str(err)
    assert str(wal_dir) in message and f"{err.nbytes} bytes" in message
    assert f"{err.free_bytes} bytes free" in message
    assert errno.errorcode[error] in message and "Nothing of this request was stored" in message
    assert segment_sizes(wal_dir) == sizes
    assert wal.head_lsn() == 3
    assert list(wal.read(1)) == acked
    assert len(heard) == 2 and groups == [2, 1]

    assert wal.append_blocking([(1, b"d"), (0, b"e")]) == (4, 5)
    assert list(wal.read(4)) == [Record(4, 1, 2, b"d"), Record(5, 0, 3, b"e")]
    assert heard[-1] == list(wal.read(4)) and groups == [2, 1, 2]
    wal.close()
    with capture_logs() as logs, Wal.open(wal_dir) as again:
        assert list(again.read(1)) == [*acked, Record(4, 1, 2, b"d"), Record(5, 0, 3, b"e")]
    assert not [e for e in logs if e["event"] == "wal.torn_tail_cut"]


def test_a_new_core_whose_first_group_failed_starts_at_sequence_1(open_wal: OpenWal) -> None:
    wal = open_wal()
    wal.append_blocking([(0, b"a")])
    with (
        mock.patch.object(os, "pwritev", side_effect=failing_once(REAL_PWRITEV, errno.ENOSPC)),
        pytest.raises(WalFullError),
    ):
        wal.append_blocking([(7, b"lost"), (0, b"lost")])
    wal.append_blocking([(0, b"b"), (7, b"c")])
    assert list(wal.read(1)) == [
        Record(1, 0, 1, b"a"),
        Record(2, 0, 2, b"b"),
        Record(3, 7, 1, b"c"),
    ]


@pytest.mark.parametrize("call", ["open", "write"])
def test_rotation_that_finds_the_volume_full_leaves_no_segment_and_resumes(
    open_wal: OpenWal, wal_dir: Path, call: str
) -> None:
    """1. A 4 KiB segment holds one 3000-byte event; the next append must rotate.
    2. Creating the next segment fails with ENOSPC (at its open, or at its header's
       write): WalFullError, no new file, the old segment untouched and still active.
    3. Space returns: the next append rotates and gets LSN 2.
    4. Reopen: both acknowledged records.
    """
    wal = open_wal(segment_bytes=4096)
    assert wal.append_blocking([(0, b"x" * 3000)]) == (1, 1)
    sizes = segment_sizes(wal_dir)
    real = {"open": REAL_OPEN, "write": REAL_WRITE}[call]
    with (
        mock.patch.object(os, call, side_effect=failing_once(real, errno.ENOSPC)),
        pytest.raises(WalFullError) as info,
    ):
        wal.append_blocking([(0, b"y" * 3000)])
    assert info.value.nbytes > 3000 + SEGMENT_HEADER_SIZE  # the header and the frame
    assert segment_sizes(wal_dir) == sizes
    assert wal.segment_count() == 1 and wal.head_lsn() == 1

    assert wal.append_blocking([(0, b"z" * 3000)]) == (2, 2)
    assert wal.segment_count() == 2
    wal.close()
    with Wal.open(wal_dir, segment_bytes=4096) as again:
        assert [(r.lsn, r.seq, r.payload) for r in again.read(1)] == [
            (1, 1, b"x" * 3000),
            (2, 2, b"z" * 3000),
        ]


def test_a_full_volume_right_after_rotation_keeps_the_new_empty_segment(
    open_wal: OpenWal, wal_dir: Path
) -> None:
    """Rotation worked, the frame write into the new segment did not: the new segment
    stays (header only, durable), and the next group goes into it at LSN 2."""
    wal = open_wal(segment_bytes=4096)
    wal.append_blocking([(0, b"x" * 3000)])
    with volume_fills_mid_frame(errno.ENOSPC), pytest.raises(WalFullError):
        wal.append_blocking([(0, b"y" * 3000)])
    sizes = segment_sizes(wal_dir)
    assert list(sizes.values())[-1] == SEGMENT_HEADER_SIZE
    assert wal.segment_count() == 2 and wal.head_lsn() == 1
    assert wal.append_blocking([(0, b"z" * 100)]) == (2, 2)
    assert wal.segment_count() == 2
    wal.close()
    with Wal.open(wal_dir, segment_bytes=4096) as again:
        assert [r.payload for r in again.read(1)] == [b"x" * 3000, b"z" * 100]


async def test_appends_of_a_full_group_fail_and_the_others_take_the_next_lsns(
    open_wal: OpenWal, wal_dir: Path
) -> None:
    """Whichever appends shared the failed group all fail (how many the writer took
    into it varies); the rest are acknowledged with consecutive LSNs right after the
    last durable one and read back exactly, and so is the append after them."""
    wal = open_wal()
    assert await wal.append([(1, b"first")]) == (1, 1)
    batches = [events(5, tag=str(k)) for k in range(10)]
    with mock.patch.object(os, "pwritev", side_effect=failing_once(REAL_PWRITEV, errno.ENOSPC)):
        results = await asyncio.gather(*(wal.append(b) for b in batches), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert failed and all(isinstance(r, WalFullError) for r in failed)
    acked = sorted(
        (r, batch) for r, batch in zip(results, batches, strict=True) if isinstance(r, tuple)
    )
    lsn = 2
    for (first, last), batch in acked:
        assert (first, last) == (lsn, lsn + len(batch) - 1)
        assert [(r.core, r.payload) for r in wal.read(first, to_lsn=last)] == batch
        lsn = last + 1
    assert wal.head_lsn() == lsn - 1
    assert await wal.append([(0, b"after")]) == (lsn, lsn)


@pytest.mark.parametrize("mode", ["interval", "never"])
def test_unsynced_groups_are_kept_and_only_the_full_one_is_undone(
    open_wal: OpenWal, wal_dir: Path, mode: str
) -> None:
    """fsync = interval | never: group A is written but not yet synced when group B
    finds the volume full. A's append has returned already, so only B is undone; A
    stays readable and survives a reopen, and C takes the LSN after A."""
    wal = open_wal(fsync=mode, fsync_interval_ms=60_000)
    assert wal.append_blocking(events(3, tag="A")) == (1, 3)
    with volume_fills_mid_frame(errno.ENOSPC), pytest.raises(WalFullError):
        wal.append_blocking(events(4, tag="B"))
    assert wal.head_lsn() == 3
    assert [(r.core, r.payload) for r in wal.read(1)] == events(3, tag="A")
    assert wal.append_blocking(events(2, tag="C")) == (4, 5)
    wal.close()
    with Wal.open(wal_dir) as again:
        assert [(r.core, r.payload) for r in again.read(1)] == [
            *events(3, tag="A"),
            *events(2, tag="C"),
        ]


def test_a_really_full_volume_refuses_appends_then_resumes_when_space_returns(
    tmp_path: Path,
) -> None:
    """1. Mount a 4 MiB tmpfs; put a 1 MiB filler file on it; open a WAL there with
       256 KiB segments.
    2. Append 16 KiB requests until one raises WalFullError; once more: still full.
    3. Delete the filler: appends succeed again, LSNs right after the last acked one.
    4. Reopen: every acknowledged record is there exactly once, in order, and
       nothing else.
    """
    with tmpfs(tmp_path / "vol", "4m") as volume:
        filler = volume / "filler"
        filler.write_bytes(b"\0" * (1024 * 1024))
        directory = volume / "wal"
        acked: list[tuple[int, bytes]] = []
        wal = Wal.open(directory, segment_bytes=256 * 1024)
        try:
            full: WalFullError | None = None
            for k in range(1000):
                request = [(i % 4, f"{k}:{i}:".encode() + b"p" * 1000) for i in range(16)]
                try:
                    first, last = wal.append_blocking(request)
                except WalFullError as exc:
                    full = exc
                    break
                assert first == len(acked) + 1 and last == first + 15
                acked += request
            assert full is not None, "the volume never filled"
            assert full.free_bytes is not None and full.free_bytes < full.nbytes
            assert len(acked) > 16 * 100
            with pytest.raises(WalFullError):
                wal.append_blocking([(0, b"still full" * 3000)])
            assert wal.head_lsn() == len(acked)

            filler.unlink()
            for k in range(20):
                request = [(i % 4, f"after{k}:{i}:".encode() + b"q" * 1000) for i in range(16)]
                first, _last = wal.append_blocking(request)
                assert first == len(acked) + 1
                acked += request
        finally:
            wal.close()
        with Wal.open(directory, segment_bytes=256 * 1024) as again:
            got = list(again.read(1))
        assert [r.lsn for r in got] == list(range(1, len(acked) + 1))
        assert [(r.core, r.payload) for r in got] == acked
