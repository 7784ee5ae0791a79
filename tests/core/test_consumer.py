"""Replay chunking, and the columnar rows that slices are made of."""

from __future__ import annotations

import pytest

from daemon.consumer import _take
from daemon.planner import Rows, part_bytes, split_part
from tests.core.conftest import columnar, rec


def test_replay_chunks_stop_near_the_byte_bound_even_for_large_events() -> None:
    frames = iter([columnar([lsn], payload=b"x" * 10_000) for lsn in range(1, 1001)])

    chunk, dry = _take(frames, rows=16_384, max_bytes=100_000)

    assert not dry
    assert 100_000 <= sum(map(part_bytes, chunk)) <= 100_000 + part_bytes(chunk[-1])


def test_replay_chunk_reports_the_end_of_the_wal() -> None:
    chunk, dry = _take(iter([columnar([1, 2]), columnar([3])]), rows=10, max_bytes=1 << 20)
    assert [list(b.lsns) for b in chunk] == [[1, 2], [3]]
    assert dry


def test_replay_chunk_is_bounded_by_rows() -> None:
    frames = iter([columnar(list(range(i, i + 100))) for i in range(1, 2000, 100)])
    chunk, dry = _take(frames, rows=700, max_bytes=1 << 30)
    assert sum(map(len, chunk)) == 700 and not dry
    assert next(frames).lsns[0] == 701  # nothing taken beyond the chunk


def test_rows_over_ring_lists_and_wal_batches_read_as_one_record_sequence() -> None:
    rows = Rows([[rec(1), rec(2)], columnar([5, 6, 9], payload=b"ab"), [rec(10)]])

    assert len(rows) == 6
    assert [r.lsn for r in rows] == [1, 2, 5, 6, 9, 10]
    assert rows[2] == rec(5, payload=b"ab")
    assert rows[-1] == rec(10)
    # A batch's sequences run on from its first one; LSNs need not be contiguous.
    assert rows == [
        rec(1),
        rec(2),
        rec(5, payload=b"ab"),
        rec(6, payload=b"ab"),
        rec(9, seq=7, payload=b"ab"),
        rec(10),
    ]
    with pytest.raises(IndexError):
        rows[6]


def test_splitting_a_wal_batch_keeps_every_event_and_its_payload() -> None:
    batch = columnar([3, 4, 8, 9], payload=b"xyz")
    head, tail = split_part(batch, 3)
    assert list(Rows([head])) == [
        rec(3, payload=b"xyz"),
        rec(4, payload=b"xyz"),
        rec(8, seq=5, payload=b"xyz"),
    ]
    assert list(Rows([tail])) == [rec(9, seq=6, payload=b"xyz")]
    assert part_bytes(head) + part_bytes(tail) == part_bytes(batch)
