"""The WAL directory lock: a second open is refused with an error naming the holder, and a
holder killed with SIGKILL never blocks the next open (real subprocesses, real files)."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.wal.helpers import OpenWal, ready_child
from wal import Wal, WalLockedError


@pytest.fixture
def holder(wal_dir: Path) -> Iterator[subprocess.Popen[str]]:
    """A child process that holds the WAL in ``wal_dir`` open (killed at the end)."""
    with ready_child("tests.wal.lock_holder", str(wal_dir)) as child:
        yield child


@pytest.mark.crash
def test_a_second_open_names_the_holder_and_a_sigkilled_holder_blocks_nothing(
    wal_dir: Path, holder: subprocess.Popen[str]
) -> None:
    """1. A child process opens the WAL and keeps it open.
    2. Opening it here is refused; the message names the child's pid, host, start time,
       data_dir and config.
    3. The child is SIGKILLed (no cleanup runs): the next open succeeds and the lock
       file now names this process."""
    host = socket.gethostname()
    with pytest.raises(WalLockedError) as refused:
        Wal.open(wal_dir)
    message = str(refused.value)
    assert f"its lock {wal_dir / 'LOCK'} is held by pid {holder.pid} on host {host} since " in (
        message
    )
    assert f"(data_dir {wal_dir.parent}, config /etc/ep.toml)" in message
    assert "this process" not in message

    holder.send_signal(signal.SIGKILL)
    assert holder.wait() == -signal.SIGKILL
    with Wal.open(wal_dir) as wal:
        assert wal.head_lsn() == 0
        text = (wal_dir / "LOCK").read_text()
    assert f'"pid": {os.getpid()}, "host": "{host}"' in text
    assert str(holder.pid) not in text.split('"since"')[0]


def test_a_second_open_in_the_same_process_says_so(open_wal: OpenWal, wal_dir: Path) -> None:
    open_wal(holder={"data_dir": "/srv/ep"})
    with pytest.raises(WalLockedError, match=rf"held by pid {os.getpid()} on host .+ since \S+Z "
                       r"\(this process, data_dir /srv/ep\); stop that process"):  # fmt: skip
        open_wal()


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "held by a process that did not name itself (the lock file is empty"),
        (b"\x00\xffnot json", "held by a process that cannot be named (the lock file holds"),
        (b'{"pid": 7}', "held by a process that cannot be named (the lock file holds"),
    ],
)
def test_a_holder_that_did_not_name_itself_is_still_refused_plainly(
    wal_dir: Path, content: bytes, said: str
) -> None:
    """A holder that wrote nothing (an older eventplane, or one still starting) or something
    else: the refusal is the same WalLockedError and says the holder is unknown."""
    Wal.open(wal_dir).close()
    (wal_dir / "LOCK").write_bytes(content)
    fd = os.open(wal_dir / "LOCK", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(WalLockedError, match="in use") as refused:
            Wal.open(wal_dir)
        assert said in str(refused.value)
    finally:
        os.close(fd)
    Wal.open(wal_dir).close()  # released: opens again
