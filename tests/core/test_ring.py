"""Rings: bounded by count and bytes, never blocking, with backpressure hysteresis."""

from __future__ import annotations

import gc
import tracemalloc
from array import array
from itertools import accumulate, chain

import pytest

from daemon.errors import LsnRegressionError
from daemon.plane.parts import COLUMNAR_OVERHEAD_BYTES, PART_OVERHEAD_BYTES
from daemon.plane.ring import Backpressure, Ring, RingSet, next_state
from daemon.service.metrics import Metrics
from tests.core.conftest import rec
from wal.format import encode_frame
from wal.log import _section_batches
from wal.reader import RecordBatch
from wal.record import Record

N, T, S = Backpressure.NORMAL, Backpressure.THROTTLED, Backpressure.SUSPENDED


@pytest.mark.parametrize(
    ("state", "fill", "expected"),
    [
        (N, 0.84, N),
        (N, 0.85, T),
        (N, 0.95, S),  # a burst can jump straight to Suspended
        (T, 0.80, T),  # stays until below 75 %
        (T, 0.7499, N),
        (T, 0.95, S),
        (S, 0.90, S),  # stays until below 85 %
        (S, 0.80, T),
        (S, 0.50, N),
    ],
)
def test_backpressure_hysteresis_table(
    state: Backpressure, fill: float, expected: Backpressure
) -> None:
    assert next_state(state, fill) is expected


def test_full_ring_drops_without_blocking_and_emitted_still_advances() -> None:
    ring = Ring(0, capacity=4, max_bytes=1 << 20)
    kept = [ring.offer(rec(lsn)) for lsn in range(1, 7)]
    ring.settle()

    assert kept == [True, True, True, True, False, False]
    assert len(ring) == 4
    assert ring.emitted == 6
    assert ring.dropped == 2
    assert ring.last_drop_lsn == 6
    assert [r.lsn for r in ring.take(10)] == [1, 2, 3, 4]


def test_ring_is_bounded_by_payload_bytes() -> None:
    ring = Ring(0, capacity=100, max_bytes=10)
    assert ring.offer(rec(1, payload=b"123456"))
    assert not ring.offer(rec(2, payload=b"123456"))  # would make 12 bytes
    assert ring.offer(rec(3, payload=b"1234"))  # fits again: the consumer sees a gap
    assert ring.nbytes == 10
    ring.settle()
    assert ring.state is Backpressure.SUSPENDED  # byte fill 100 %


def test_backpressure_transitions_are_counted_per_core() -> None:
    m = Metrics()
    rings = RingSet(2, capacity=20, max_bytes=1 << 20, metrics=m)
    rings.push_group([rec(lsn, core=1) for lsn in range(1, 18)])  # 85 %
    assert rings[1].state is T
    rings.push_group([rec(lsn, core=1) for lsn in range(18, 20)])  # 95 %
    assert rings[1].state is S
    rings[1].take(2)  # 85 %: still Suspended
    assert rings[1].state is S
    rings[1].take(3)  # 70 %: below both exits
    assert rings[1].state is N

    def count(to: str) -> float:
        value = m.registry.get_sample_value(
            "eventplane_backpressure_transitions_total", {"core": "1", "to": to}
        )
        return value or 0.0

    assert (count("throttled"), count("suspended"), count("normal")) == (1, 1, 1)
    assert m.registry.get_sample_value("eventplane_backpressure_state", {"core": "1"}) == 0
    assert rings[0].state is N


def test_push_group_counts_drops_and_tracks_pushed_lsn() -> None:
    m = Metrics()
    rings = RingSet(2, capacity=2, max_bytes=1 << 20, metrics=m)
    rings.push_group([rec(1, 0), rec(2, 1), rec(3, 0), rec(4, 0), rec(5, 0)])

    assert rings.pushed_lsn == 5
    assert m.registry.get_sample_value("eventplane_ring_dropped_events_total", {"core": "0"}) == 2
    assert m.registry.get_sample_value("eventplane_ring_utilization_ratio", {"core": "0"}) == 1.0


def test_push_group_refuses_lsns_that_do_not_grow() -> None:
    rings = RingSet(1, capacity=8, max_bytes=1 << 20, pushed_lsn=10)
    with pytest.raises(LsnRegressionError, match="LSN 10 after LSN 10"):
        rings.push_group([rec(10)])


def test_push_group_refuses_unknown_core() -> None:
    rings = RingSet(2, capacity=8, max_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"core 2, but daemon\.cores = 2"):
        rings.push_group([rec(1, core=2)])


def test_discard_through_drops_only_delivered_entries() -> None:
    ring = Ring(0, capacity=8, max_bytes=1 << 20)
    for lsn in (3, 5, 9, 12):
        ring.offer(rec(lsn))
    assert ring.discard_through(9) == 3
    assert ring.peek() == rec(12)
    assert ring.nbytes == 1


def test_push_group_refuses_a_repeated_lsn_inside_a_group_and_offers_nothing() -> None:
    """[1, 1, 3] spans 1..3 like a consecutive group would; every LSN is still checked."""
    rings = RingSet(1, capacity=8, max_bytes=1 << 20)
    with pytest.raises(LsnRegressionError, match="LSN 1 after LSN 1"):
        rings.push_group([rec(1), rec(1), rec(3)])
    assert len(rings[0]) == 0 and rings.pushed_lsn == 0


def test_offer_all_keeps_per_record_semantics_when_the_group_does_not_fit() -> None:
    """Bytes bound: a record that does not fit is dropped, a later smaller one is kept."""
    bulk = RingSet(1, capacity=8, max_bytes=10)[0]
    one_by_one = RingSet(1, capacity=8, max_bytes=10)[0]
    group = [rec(1, payload=b"123456"), rec(2, payload=b"123456"), rec(3, payload=b"1234")]

    dropped = bulk.offer_all(group)
    kept = [one_by_one.offer(r) for r in group]

    assert dropped == kept.count(False) == 1
    assert [r.lsn for r in bulk.take(8)] == [r.lsn for r in one_by_one.take(8)] == [1, 3]
    assert bulk.emitted == one_by_one.emitted and bulk.last_drop_lsn == 2


def run(lsns: list[int], seq: int, core: int = 0, sizes: list[int] | None = None) -> RecordBatch:
    """A run as the WAL's batch listener makes it: consecutive sequences from ``seq``."""
    sizes = sizes or [1] * len(lsns)
    data = b"".join(bytes([65 + i % 26]) * k for i, k in enumerate(sizes))
    return RecordBatch(core, array("Q", lsns), seq, array("Q", accumulate(sizes, initial=0)), data)


def test_offer_run_drops_exactly_what_single_offers_would_drop() -> None:
    """Bytes bound 10: of sizes 4, 5, 3, 1 the 3 does not fit, the 1 after it does;
    the kept records come back as two runs with their own sequences and payloads."""
    whole = Ring(0, capacity=8, max_bytes=10)
    single = Ring(0, capacity=8, max_bytes=10)
    r = run([11, 12, 13, 14], seq=5, sizes=[4, 5, 3, 1])

    assert whole.offer_run(r) == 1
    kept = [single.offer(x) for x in r.records()]

    assert kept == [True, True, False, True]
    assert (whole.dropped, whole.last_drop_lsn, whole.emitted, whole.offered_lsn) == (1, 13, 8, 14)
    assert (len(whole), whole.nbytes) == (len(single), single.nbytes) == (3, 10)
    taken = whole.take_runs(8)
    assert [(t.lsns.tolist(), t.first_seq, t.payloads()) for t in taken] == [
        ([11, 12], 5, [b"AAAA", b"BBBBB"]),
        ([14], 8, [b"D"]),
    ]
    assert [x.lsn for x in single.take(8)] == [11, 12, 14]


def test_take_runs_splits_the_last_run_at_the_limit_and_keeps_the_rest_in_order() -> None:
    ring = Ring(0, capacity=100, max_bytes=1 << 20)
    ring.offer_run(run([1, 2, 3], seq=1, sizes=[1, 2, 3]))
    ring.offer_run(run([4, 5, 6, 7], seq=4, sizes=[1, 1, 1, 4]))

    first = ring.take_runs(5)
    assert [(t.lsns.tolist(), t.first_seq) for t in first] == [([1, 2, 3], 1), ([4, 5], 4)]
    assert first[1].offsets.tolist() == [0, 1, 2]
    assert (len(ring), ring.nbytes) == (2, 5)
    rest = ring.take_runs(5)
    assert [(t.lsns.tolist(), t.first_seq, t.payloads()) for t in rest] == [
        ([6, 7], 6, [b"C", b"DDDD"])
    ]
    assert rest[0].offsets.tolist() == [0, 1, 5]  # rebased: Arrow's layout starts at 0
    assert (len(ring), ring.nbytes, ring.take_runs(5)) == (0, 0, [])


def test_discard_through_cuts_a_run_in_the_middle() -> None:
    ring = Ring(0, capacity=100, max_bytes=1 << 20)
    ring.offer_run(run([3, 4], seq=1))
    ring.offer_run(run([6, 8, 9], seq=3, sizes=[1, 2, 3]))

    assert ring.discard_through(8) == 4
    assert ring.peek() == Record(9, 0, 5, b"CCC")
    assert (len(ring), ring.nbytes) == (1, 3)


def test_push_batches_offers_each_core_its_run_and_tracks_drops_and_pushed_lsn() -> None:
    m = Metrics()
    rings = RingSet(2, capacity=2, max_bytes=1 << 20, metrics=m)
    rings.push_batches([run([1, 3, 4, 5], seq=1, core=0), run([2], seq=1, core=1)])

    assert rings.pushed_lsn == 5
    assert [x.lsn for x in rings[0].take(10)] == [1, 3]
    assert rings[0].emitted == 4 and rings[0].last_drop_lsn == 5
    assert [x.lsn for x in rings[1].take(10)] == [2]
    assert m.registry.get_sample_value("eventplane_ring_dropped_events_total", {"core": "0"}) == 2


def test_push_batches_refuses_lsns_that_do_not_grow_and_offers_nothing() -> None:
    rings = RingSet(2, capacity=8, max_bytes=1 << 20, pushed_lsn=10)
    with pytest.raises(LsnRegressionError, match="LSN 10 after LSN 10"):
        rings.push_batches([run([11], seq=1, core=1), run([10, 12], seq=1, core=0)])
    assert len(rings[0]) == len(rings[1]) == 0 and rings.pushed_lsn == 10


def test_push_batches_refuses_unknown_core() -> None:
    rings = RingSet(2, capacity=8, max_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"core 2, but daemon\.cores = 2"):
        rings.push_batches([run([1], seq=1, core=2)])


def test_ring_entries_cost_at_most_the_documented_bytes_beyond_their_payload() -> None:
    """A ring entry holds ~16 B per event plus ~0.4 KiB per run beyond its payload
    (docs/consumers.md, Memory). Runs as the WAL's columnar listener makes them
    (one per core and group commit), pushed until the rings are full: one-event
    runs (a trickle of small requests) stay within COLUMNAR_OVERHEAD_BYTES +
    PART_OVERHEAD_BYTES per entry, bench/bench_overload.py's budget, and runs of
    256 within COLUMNAR_OVERHEAD_BYTES plus PART_OVERHEAD_BYTES per run."""

    def held(per_group: int) -> tuple[int, int, int]:
        """(bytes allocated beyond the payload, events, runs) of two full rings."""
        rings = RingSet(2, capacity=2048, max_bytes=1 << 30)
        next_seq: dict[int, int] = {}
        first = 1
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            while len(rings[0]) < 2048:
                cores = [0, 1] * per_group
                payloads = [b"%012d" % (first + i) + bytes(118) for i in range(len(cores))]
                frame = encode_frame(
                    1, first, cores, payloads, array("I", map(len, payloads)), next_seq
                )
                rings.push_batches(_section_batches(first, frame))
                first += len(cores)
                del frame, payloads
            gc.collect()
            real = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        runs = [r.take_runs(1 << 20) for r in rings.rings]
        payload = sum(len(x.data) for core in runs for x in core)
        return real - payload, sum(map(len, chain(*runs))), sum(map(len, runs))

    over, events, runs = held(1)
    assert events == runs == 4096
    assert over <= events * (COLUMNAR_OVERHEAD_BYTES + PART_OVERHEAD_BYTES), over / events

    over, events, runs = held(256)
    assert (events, runs) == (4096, 16)
    assert over <= events * COLUMNAR_OVERHEAD_BYTES + runs * PART_OVERHEAD_BYTES, over / events
