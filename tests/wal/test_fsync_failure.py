"""Invariant 10: a failed fdatasync (or write) is never acknowledged, and the WAL refuses every
later append instead of retrying; what was acknowledged before survives a reopen."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from unittest import mock

import pytest
from structlog.testing import capture_logs

from tests.wal.helpers import OpenWal, events
from wal import Wal, WalFatalError

REAL_FDATASYNC = os.fdatasync
REAL_PWRITEV = os.pwritev


def failing_once(real, error: int):  # type: ignore[no-untyped-def]
    """A side effect that fails the first call with ``error`` and passes later ones through."""
    calls = []

    def side_effect(*args):  # type: ignore[no-untyped-def]
        calls.append(args)
        if len(calls) == 1:
            raise OSError(error, f"injected {errno.errorcode[error]}")
        return real(*args)

    return side_effect


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


def test_failed_write_is_fatal_too(open_wal: OpenWal) -> None:
    wal = open_wal()
    with mock.patch.object(os, "pwritev", side_effect=failing_once(REAL_PWRITEV, errno.ENOSPC)):
        with pytest.raises(WalFatalError) as info:
            wal.append_blocking(events(3))
        assert "ENOSPC" in repr(info.value.__cause__) or "No space" in str(info.value.__cause__)
    with pytest.raises(WalFatalError):
        wal.append_blocking(events(3))
    assert wal.head_lsn() == 0


def test_failed_interval_fsync_refuses_later_appends(open_wal: OpenWal) -> None:
    wal = open_wal(fsync="interval", fsync_interval_ms=1)
    wal.append_blocking([(0, b"a")])
    with (
        mock.patch.object(os, "fdatasync", side_effect=OSError(errno.EIO, "injected EIO")),
        pytest.raises(WalFatalError),
    ):
        for _ in range(200):  # the writer syncs within ~1 ms; the failure surfaces
            wal.append_blocking([(0, b"b")])
