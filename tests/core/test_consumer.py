"""Replay chunking, ring packing, and the columnar rows that slices are made of."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from daemon.config import ConsumerConfig
from daemon.plane.consumer import Consumer, Mode, _take
from daemon.plane.parts import (
    COLUMNAR_OVERHEAD_BYTES,
    PART_OVERHEAD_BYTES,
    Part,
    Rows,
    pack,
    part_bytes,
    split_part,
)
from daemon.plane.ring import Ring
from daemon.service.metrics import Metrics
from tests.core.conftest import columnar, rec
from wal.reader import RecordBatch
from wal.record import Record


def test_replay_chunks_stop_near_the_byte_bound_even_for_large_events() -> None:
    frames = iter([columnar([lsn], payload=b"x" * 10_000) for lsn in range(1, 1001)])

    chunk, dry = _take(frames, rows=16_384, max_bytes=100_000)

    assert not dry
    assert 100_000 <= sum(map(part_bytes, chunk)) <= 100_000 + part_bytes(chunk[-1])


def test_replay_chunk_reports_the_end_of_the_wal() -> None:
    chunk, dry = _take(iter([columnar([1, 2]), columnar([3])]), rows=10, max_bytes=1 << 20)
    assert [list(b.lsns) for b in chunk] == [[1, 2, 3]]  # small parts come back joined
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
    # Two parts now: the events' bytes are the same, plus one more part's overhead.
    assert part_bytes(head) + part_bytes(tail) == part_bytes(batch) + PART_OVERHEAD_BYTES


def test_ring_records_packed_into_one_part_read_back_as_the_same_records() -> None:
    records = [rec(lsn, seq=40 + i, payload=b"p%d" % lsn) for i, lsn in enumerate([3, 4, 9])]

    part = pack(records)

    assert isinstance(part, RecordBatch) and part.first_seq == 40
    assert list(Rows([part])) == records
    assert part_bytes(part) == len(b"p3p4p9") + 3 * COLUMNAR_OVERHEAD_BYTES + PART_OVERHEAD_BYTES


def test_part_bytes_covers_what_pending_parts_really_allocate() -> None:
    """The budget counts at least what a pending part allocates: packed parts of
    one event (per-part overhead) and of many, and plain Record lists (as ring
    entries: a tuple, two ints and an exact-size payload each)."""

    def allocated(make: Callable[[], Part]) -> tuple[int, int]:
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            held = []
            for _ in range(200):
                part = make()
                held.append((part, part_bytes(part)))  # as the planner keeps it
            real = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        return real, sum(size for _, size in held)

    def fresh(n: int) -> list[Record]:
        base = next(lsns)
        return [Record(base + i, 1, base + i, bytes(130)) for i in range(n)]

    lsns = itertools.count(3_000_000_000, 10_000)
    for make in (lambda: pack(fresh(1)), lambda: pack(fresh(500)), lambda: fresh(50)):
        real, counted = allocated(make)
        assert real <= counted, (real, counted)


async def test_normal_mode_hands_the_planner_packed_parts_with_every_event() -> None:
    """1. Boot: the WAL is empty, so catch-up ends at once (Normal).
    2. Two durable groups reach the ring.
    3. The sink gets columnar parts holding exactly those events, in order."""
    sink = RecordingSink()
    ring = Ring(0, capacity=100, max_bytes=1 << 20)
    consumer = Consumer(
        0, ConsumerConfig(poll_min_ms=0.1), ring, EmptyWal(), sink, Metrics(), start_lsn=0
    )
    task = asyncio.create_task(consumer.run())
    try:
        sent = [rec(lsn, seq=lsn, payload=b"e%d" % lsn) for lsn in range(1, 8)]
        ring.offer_all(sent[:3])
        ring.offer_all(sent[3:])
        async with asyncio.timeout(5):
            while sum(map(len, sink.parts)) < len(sent):
                sink.added.clear()
                await sink.added.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    assert all(isinstance(p, RecordBatch) for p in sink.parts)
    assert list(Rows(sink.parts)) == sent


class EmptyWal:
    def read_batches(
        self, from_lsn: int, *, core: int | None = None, to_lsn: int | None = None
    ) -> Iterator[RecordBatch]:
        return iter(())

    def head_lsn(self) -> int:
        return 0


class RecordingSink:
    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.added = asyncio.Event()

    def add(self, core: int, part: Part, nbytes: int | None = None) -> None:
        self.parts.append(part)
        self.added.set()

    def has_room(self, core: int) -> bool:
        return True

    async def wait_room(self, core: int) -> None:
        return None

    def set_catching_up(self, core: int, flag: bool) -> None:
        return None


class ListWal:
    """A WAL stand-in over one core's batches (for one consumer's unit tests)."""

    def __init__(self, batches: list[RecordBatch]) -> None:
        self.batches = batches

    def read_batches(
        self, from_lsn: int, *, core: int | None = None, to_lsn: int | None = None
    ) -> Iterator[RecordBatch]:
        for b in self.batches:
            keep = [i for i, lsn in enumerate(b.lsns) if lsn >= from_lsn]
            if keep:
                yield split_part(b, keep[0])[1] if keep[0] else b  # type: ignore[misc]

    def head_lsn(self) -> int:
        return self.batches[-1].lsns[-1]


async def test_a_run_that_does_not_continue_the_sequence_is_a_gap_and_the_wal_fills_it() -> None:
    """1. Boot on an empty log: Normal.
    2. The ring gets the run of sequences 1-3, then one of 6-7 (4-5 never reached it).
    3. The consumer delivers 1-3 only, enters CatchUp for a gap, replays 4-7 from
       the WAL, and drops the ring's 6-7: every event once, in LSN order."""
    sink = RecordingSink()
    ring = Ring(0, capacity=100, max_bytes=1 << 20)
    sent = [rec(lsn, seq=lsn, payload=b"e%d" % lsn) for lsn in range(1, 8)]
    wal = ListWal([])
    metrics = Metrics()
    consumer = Consumer(
        0, ConsumerConfig(poll_min_ms=0.1), ring, EmptyWal(), sink, metrics, start_lsn=0
    )
    task = asyncio.create_task(consumer.run())
    try:
        async with asyncio.timeout(5):
            while consumer.mode is not Mode.NORMAL:  # noqa: ASYNC110 - the consumer's state
                await asyncio.sleep(0.001)
        wal.batches = [pack(sent)]  # the log holds all seven
        consumer.wal = wal
        ring.offer_run(pack(sent[:3]))
        ring.offer_run(pack(sent[5:]))
        async with asyncio.timeout(5):
            while sum(map(len, sink.parts)) < len(sent) or consumer.mode is not Mode.NORMAL:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    assert [len(p) for p in sink.parts] == [3, 4]
    assert list(Rows(sink.parts)) == sent
    gaps = metrics.registry.get_sample_value(
        "eventplane_consumer_catchup_entries_total", {"core": "0", "reason": "gap"}
    )
    assert gaps == 1
    assert len(ring) == 0 and consumer.last_seq == 7
