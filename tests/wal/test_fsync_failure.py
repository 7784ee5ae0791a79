"""Invariant 10: a failed fdatasync (whatever its errno) or a failed write other than "no space"
is never acknowledged, and the WAL refuses every later append instead of retrying; what was
acknowledged before survives a reopen. A write that finds no space: test_full_volume.py."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from unittest import mock

import pytest
from structlog.testing import capture_logs

from tests.wal.helpers import OpenWal, events, failing_once
from wal import Wal, WalFatalError

REAL_FDATASYNC = os.fdatasync
REAL_PWRITEV = os.pwritev
REAL_FSYNC = os.fsync
REAL_FTRUNCATE = os.ftruncate


def test_failed_fdatasync_is_not_acknowledged_and_every_later_append_is_refused(
    open_wal: OpenWal, wal_dir: Path
) -> None:
    """1. One append succeeds.
    2. fdatasync fails once (EIO): that append raises WalFatalError caused by the OSError.
    3. fdatasync works again, yet the next append is refused: no retry after a failed fsync.
    4. Reopen: the acknowledged event is there.
    """
    wal = open_wal()
    assert wal.append_blocking([(0, b"acked")]) == (1, 1)
    with (
        mock.patch.object(os, "fdatasync", side_effect=failing_once(REAL_FDATASYNC, errno.EIO)),
        capture_logs() as logs,
    ):
        with pytest.raises(WalFatalError) as info:
            wal.append_blocking([(0, b"never acked")])
        assert isinstance(info.value.__cause__, OSError)
        assert wal.head_lsn() == 1
        with pytest.raises(WalFatalError, match="refuses"):
            wal.append_blocking([(0, b"later")])
    assert any(e["event"] == "wal.fatal" for e in logs)
    wal.close()
    with Wal.open(wal_dir) as again:
        assert [r.payload for r in again.read(1, to_lsn=1)] == [b"acked"]
        assert again.head_lsn() <= 2  # the failed group may have reached the disk: never acked


async def test_concurrent_appends_sharing_a_failed_fsync_all_fail(open_wal: OpenWal) -> None:
    wal = open_wal()
    await wal.append([(1, b"first")])
    with mock.patch.object(os, "fdatasync", side_effect=failing_once(REAL_FDATASYNC, errno.EIO)):
        results = await asyncio.gather(
            *(wal.append(events(5, tag=str(k))) for k in range(10)), return_exceptions=True
        )
        assert results and all(isinstance(r, WalFatalError) for r in results)
        with pytest.raises(WalFatalError):
            await wal.append([(0, b"after")])
    assert wal.head_lsn() == 1


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EDQUOT, errno.EIO], ids=errno.errorcode.get)
def test_failed_fdatasync_is_fatal_whatever_its_errno(open_wal: OpenWal, error: int) -> None:
    """ENOSPC from fdatasync is not "the volume is full, retry later": the kernel may
    have dropped the group's dirty pages already, so it is fatal like EIO."""
    wal = open_wal()
    wal.append_blocking([(0, b"acked")])
    with mock.patch.object(os, "fdatasync", side_effect=failing_once(REAL_FDATASYNC, error)):
        with pytest.raises(WalFatalError) as info:
            wal.append_blocking([(0, b"never acked")])
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == error
        with pytest.raises(WalFatalError):
            wal.append_blocking([(0, b"later")])
    assert wal.head_lsn() == 1


def test_failed_write_other_than_no_space_is_fatal_too(open_wal: OpenWal) -> None:
    wal = open_wal()
    with mock.patch.object(os, "pwritev", side_effect=failing_once(REAL_PWRITEV, errno.EIO)):
        with pytest.raises(WalFatalError) as info:
            wal.append_blocking(events(3))
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.EIO
    with pytest.raises(WalFatalError):
        wal.append_blocking(events(3))
    assert wal.head_lsn() == 0


def test_enospc_from_the_seal_fsync_at_rotation_is_fatal(open_wal: OpenWal) -> None:
    """fsync = interval: the first group is written, not synced; the second rotates,
    and sealing syncs the first group's segment, which fails with ENOSPC: fatal, as
    that group's pages may be gone."""
    wal = open_wal(segment_bytes=4096, fsync="interval", fsync_interval_ms=60_000)
    wal.append_blocking([(0, b"x" * 3000)])
    with mock.patch.object(os, "fdatasync", side_effect=failing_once(REAL_FDATASYNC, errno.ENOSPC)):
        with pytest.raises(WalFatalError):
            wal.append_blocking([(0, b"y" * 3000)])
        with pytest.raises(WalFatalError):
            wal.append_blocking([(0, b"z")])
    assert wal.segment_count() == 1


def test_enospc_from_the_new_segment_fsync_is_fatal(open_wal: OpenWal, wal_dir: Path) -> None:
    """The new segment's header was written; its fsync said ENOSPC: fatal, not a full volume."""
    wal = open_wal(segment_bytes=4096)
    wal.append_blocking([(0, b"x" * 3000)])
    with (
        mock.patch.object(os, "fsync", side_effect=failing_once(REAL_FSYNC, errno.ENOSPC)),
        pytest.raises(WalFatalError),
    ):
        wal.append_blocking([(0, b"y" * 3000)])
    wal.close()
    with Wal.open(wal_dir, segment_bytes=4096) as again:
        assert [r.payload for r in again.read(1)] == [b"x" * 3000]


def test_failed_rollback_after_a_full_volume_is_fatal(open_wal: OpenWal, wal_dir: Path) -> None:
    """The write found no space, and cutting the partial frame failed too: fatal."""
    wal = open_wal()
    wal.append_blocking([(0, b"acked")])
    with (
        mock.patch.object(os, "pwritev", side_effect=failing_once(REAL_PWRITEV, errno.ENOSPC)),
        mock.patch.object(os, "ftruncate", side_effect=failing_once(REAL_FTRUNCATE, errno.EIO)),
    ):
        with pytest.raises(WalFatalError) as info:
            wal.append_blocking([(0, b"never acked")])
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.EIO
    with pytest.raises(WalFatalError):
        wal.append_blocking([(0, b"later")])
    wal.close()
    with Wal.open(wal_dir) as again:
        assert [r.payload for r in again.read(1)] == [b"acked"]


def test_failed_interval_fsync_refuses_later_appends(open_wal: OpenWal) -> None:
    wal = open_wal(fsync="interval", fsync_interval_ms=1)
    wal.append_blocking([(0, b"a")])
    with (
        mock.patch.object(os, "fdatasync", side_effect=OSError(errno.EIO, "injected EIO")),
        pytest.raises(WalFatalError),
    ):
        for _ in range(200):  # the writer syncs within ~1 ms; the failure surfaces
            wal.append_blocking([(0, b"b")])
