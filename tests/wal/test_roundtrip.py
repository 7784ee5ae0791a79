"""Appends come back from read() exactly, in LSN order, across reopen and rotation."""

from __future__ import annotations

import asyncio

from tests.wal.conftest import OpenWal, events
from wal import Record


async def test_concurrent_appends_get_consecutive_lsns_and_read_back_in_order(
    open_wal: OpenWal,
) -> None:
    wal = open_wal(segment_bytes=16 * 1024)
    batches = [events(37, tag=f"b{k}") for k in range(40)]
    ranges = await asyncio.gather(*(wal.append(b) for b in batches))
    assert sorted(ranges)[0][0] == 1
    for (first, last), batch in zip(ranges, batches, strict=True):
        assert last - first + 1 == len(batch)
        got = list(wal.read(first, to_lsn=last))
        assert [(r.core, r.payload) for r in got] == batch
    assert [r.lsn for r in wal.read(1)] == list(range(1, 40 * 37 + 1))
    assert wal.head_lsn() == 40 * 37


def test_reopen_keeps_every_record_and_restarts_sequences(open_wal: OpenWal, wal_dir) -> None:
    wal = open_wal(segment_bytes=8 * 1024)
    for k in range(20):
        wal.append_blocking(events(50, tag=f"r{k}"))
    before = list(wal.read(1))
    wal.close()
    again = open_wal(segment_bytes=8 * 1024)
    assert list(again.read(1)) == before
    first, last = again.append_blocking([(2, b"after")])
    assert (first, last) == (1001, 1001)
    assert list(again.read(first)) == [Record(1001, 2, 1, b"after")]
