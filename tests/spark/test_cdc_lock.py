"""The CDC stream lock without Spark (opening a CdcSink locks the stream and reads its
ledger; no session is involved): a second writer is refused with an error naming the
holder, and a writer killed with SIGKILL never blocks the next one."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from daemon.config import CdcStream
from daemon.table.errors import CdcStreamLockedError
from daemon.table.parquet import CdcSink
from tests.wal.helpers import ready_child


def sink(path: Path, data_dir: str = "/srv/b", wal_id: str = "wal-b") -> CdcSink:
    stream = CdcStream("all", ("*",), path, format="parquet")
    return CdcSink(stream, wal_id=wal_id, cores=2, data_dir=Path(data_dir))


def test_a_second_writer_in_this_process_is_refused_and_named(tmp_path: Path) -> None:
    first = sink(tmp_path / "all", "/srv/a")
    first.open()
    try:
        with pytest.raises(CdcStreamLockedError) as refused:
            sink(tmp_path / "all").open()
    finally:
        first.close()
    message = str(refused.value)
    assert "locked by another process" in message  # what tests/spark/test_cdc.py matches
    assert (
        f"its lock {tmp_path / 'all' / '_eventplane' / 'lock'} is held by pid {os.getpid()} "
        f"on host {socket.gethostname()} since "
    ) in message
    assert "(this process, stream all, wal_id wal-b, data_dir /srv/a)" in message
    sink(tmp_path / "all").open()  # closed: the next writer gets it


@pytest.mark.crash
def test_a_writer_in_another_process_is_named_and_its_sigkill_frees_the_stream(
    tmp_path: Path,
) -> None:
    """1. A child process opens the stream and keeps it open.
    2. Opening it here is refused, naming the child's pid, host, data_dir and WAL id.
    3. The child is SIGKILLed: its restart (same WAL id) opens the stream at once."""
    args = (str(tmp_path / "all"), "/srv/a")
    with ready_child("tests.spark.cdc_lock_holder", *args) as child:
        with pytest.raises(CdcStreamLockedError) as refused:
            sink(tmp_path / "all").open()
        message = str(refused.value)
        assert f"held by pid {child.pid} on host {socket.gethostname()} since " in message
        assert "(stream all, wal_id wal-a, data_dir /srv/a)" in message
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
    again = sink(tmp_path / "all", "/srv/a", wal_id="wal-a")
    again.open()
    again.close()
