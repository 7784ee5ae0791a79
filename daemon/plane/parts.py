"""Pending rows as parts: columnar ``RecordBatch`` runs or ``Record`` lists.

What the consumers deliver and the planner holds: ``pack`` (a ring run as one
columnar part), ``join_small_parts`` (small WAL replay parts joined),
``split_part``, the memory a part costs (``part_bytes``, counted against
``consumer.pending_max_bytes``), and ``Rows``, a slice's rows as one lazy
``Sequence[Record]`` over its parts.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate
from operator import itemgetter
from typing import overload

from wal.reader import RecordBatch
from wal.record import Record

# In-memory cost of one Record (a row of a Record-list part; rings hold runs,
# not Records) beyond its payload: the tuple (80 B), two ints (64 B), the bytes
# object's header with pymalloc's rounding (~46 B) and the container's slot
# (8 B). Measured with pymalloc's own block counts on CPython 3.11: 198 B for
# ~130-byte events with exact-size payloads.
RECORD_OVERHEAD_BYTES = 200
# The same for one event of a columnar RecordBatch: a u64 LSN and a u64 offset,
# in arrays built by appending (CPython over-allocates them by ~1/16).
COLUMNAR_OVERHEAD_BYTES = 18
# ... and for each columnar part: the RecordBatch, its two arrays (with their
# over-allocation) and the planner's (part, bytes) entry. Measured 130-530 B
# per part (pymalloc and glibc counts); a part can be one event, so it counts.
PART_OVERHEAD_BYTES = 512

_payload = itemgetter(3)

# Delivered rows come in parts: columnar batches from WAL replay (CatchUp) and
# from the ring (Normal: the consumer packs each in-order run, see ``pack``);
# record lists are accepted too. Pending rows stay columnar because a Record
# per event costs ~0.2 KiB of heap beyond its payload and, being a tuple
# subclass, is never untracked by the cyclic GC: a million of them pending made
# replay 3-5x slower. A ~130-byte event costs 330 B as a Record, 150 B packed.
Part = list[Record] | RecordBatch


def part_bytes(part: Part) -> int:
    """Memory a pending part holds (what the pending budget counts)."""
    if isinstance(part, RecordBatch):
        return len(part.data) + COLUMNAR_OVERHEAD_BYTES * len(part) + PART_OVERHEAD_BYTES
    return sum(map(len, map(_payload, part))) + RECORD_OVERHEAD_BYTES * len(part)


def first_lsn(part: Part) -> int:
    return part.lsns[0] if isinstance(part, RecordBatch) else part[0].lsn


def last_lsn(part: Part) -> int:
    return part.lsns[-1] if isinstance(part, RecordBatch) else part[-1].lsn


_lsn = itemgetter(0)


def pack(records: Sequence[Record]) -> RecordBatch:
    """Records of one core with consecutive sequences, as one columnar part.

    The consumer packs what it takes from the ring (~80 ns per event), so a
    pending event costs its payload plus ``COLUMNAR_OVERHEAD_BYTES`` instead of
    a Record's ``RECORD_OVERHEAD_BYTES``, and the Records die young, leaving
    no long-lived small objects to pin pymalloc's arenas.
    """
    payloads = list(map(_payload, records))
    first = records[0]
    return RecordBatch(
        first.core,
        array("Q", map(_lsn, records)),
        first.seq,
        array("Q", accumulate(map(len, payloads), initial=0)),
        b"".join(payloads),
    )


# Replayed parts under this many events are joined with their neighbours
# (``join_small_parts``); bigger ones already spread PART_OVERHEAD_BYTES thin.
SMALL_PART_EVENTS = 256


def join_small_parts(parts: Sequence[RecordBatch]) -> list[RecordBatch]:
    """Runs of small parts whose sequences continue each other, as one part each.

    WAL replay yields one part per frame section: with small frames (one
    request of a few events per group commit) that is an object and
    ``PART_OVERHEAD_BYTES`` of budget per event or two. Joining costs ~40 ns
    per joined event; parts of ``SMALL_PART_EVENTS`` or more pass as they are.
    A sequence gap (sequences restart with the process) ends a run.
    """
    out: list[RecordBatch] = []
    run: list[RecordBatch] = []
    for part in parts:
        if run and (
            len(part) >= SMALL_PART_EVENTS
            or part.first_seq != run[-1].first_seq + len(run[-1])
            or part.core != run[-1].core
        ):
            out.append(_join(run))
            run = []
        if len(part) >= SMALL_PART_EVENTS:
            out.append(part)
        else:
            run.append(part)
    if run:
        out.append(_join(run))
    return out


def _join(run: list[RecordBatch]) -> RecordBatch:
    if len(run) == 1:
        return run[0]
    lsns = array("Q")
    offsets = array("Q", (0,))
    base = 0
    for part in run:
        lsns.extend(part.lsns)
        offsets.extend(map(base.__add__, part.offsets[1:]))
        base += len(part.data)
    first = run[0]
    return RecordBatch(first.core, lsns, first.first_seq, offsets, b"".join(p.data for p in run))


def split_part(part: Part, k: int) -> tuple[Part, Part]:
    """The first ``k`` events and the rest."""
    if not isinstance(part, RecordBatch):
        return part[:k], part[k:]
    offs = part.offsets
    cut = offs[k]
    head = RecordBatch(part.core, part.lsns[:k], part.first_seq, offs[: k + 1], part.data[:cut])
    tail = RecordBatch(
        part.core,
        part.lsns[k:],
        part.first_seq + k,
        array("Q", map(cut.__rsub__, offs[k:])),
        part.data[cut:],
    )
    return head, tail


class Rows(Sequence[Record]):
    """A slice's rows, in LSN order: a lazy ``Sequence[Record]`` over parts.

    Iterating makes the Record objects; :meth:`parts` hands the columnar
    batches (Arrow layout) to executors that can use them without that.
    """

    __slots__ = ("_ends", "_parts")

    def __init__(self, parts: Sequence[Part] = ()) -> None:
        self._parts = list(parts)
        self._ends = list(accumulate(map(len, self._parts)))

    def parts(self) -> list[Part]:
        return list(self._parts)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __iter__(self) -> Iterator[Record]:
        for part in self._parts:
            yield from (part.records() if isinstance(part, RecordBatch) else part)

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Record]: ...

    def __getitem__(self, index: int | slice) -> Record | Sequence[Record]:
        if isinstance(index, slice):
            return list(self)[index]
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"row {index} out of range ({n} rows)")
        k = bisect_right(self._ends, i)
        part = self._parts[k]
        j = i - (self._ends[k - 1] if k else 0)
        if isinstance(part, RecordBatch):
            return Record(part.lsns[j], part.core, part.first_seq + j, part.payload(j))
        return part[j]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Rows({len(self)} rows in {len(self._parts)} parts)"
