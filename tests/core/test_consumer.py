"""Consumer pieces that need no running plane: chunking and the in-order check."""

from __future__ import annotations

from daemon.consumer import _take
from daemon.planner import RECORD_OVERHEAD_BYTES
from tests.core.conftest import rec


def test_replay_chunks_stop_near_the_byte_bound_even_for_large_events() -> None:
    records = iter([rec(lsn, payload=b"x" * 10_000) for lsn in range(1, 1001)])
    per_record = 10_000 + RECORD_OVERHEAD_BYTES

    chunk, dry = _take(records, rows=16_384, max_bytes=100_000)

    assert not dry
    assert 100_000 <= len(chunk) * per_record <= 100_000 + per_record


def test_replay_chunk_reports_the_end_of_the_wal() -> None:
    chunk, dry = _take(iter([rec(1), rec(2), rec(3)]), rows=10, max_bytes=1 << 20)
    assert [r.lsn for r in chunk] == [1, 2, 3]
    assert dry


def test_replay_chunk_is_bounded_by_rows() -> None:
    records = iter([rec(lsn) for lsn in range(1, 2000)])
    chunk, dry = _take(records, rows=700, max_bytes=1 << 30)
    assert len(chunk) == 700 and not dry
    assert next(records).lsn == 701  # nothing taken beyond the chunk
