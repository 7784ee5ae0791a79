"""Decoding frames into records (row form) and record batches (columnar form).

Both paths do a fixed amount of Python work per frame and section; the
per-event work runs inside C iterators (``map``, ``zip``, ``accumulate``,
``array``): that is what makes replay fast enough to matter (bench/bench_wal.py).
"""

from __future__ import annotations

import mmap
import os
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from itertools import accumulate, chain, islice, repeat
from typing import Any, TypeVar

from wal.errors import WalCorruptionError, WalReadError
from wal.format import (
    ARRAY_ITEM,
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    Frame,
    Section,
    check_frame,
    decode_u32,
)
from wal.record import Record
from wal.segments import Segment

T = TypeVar("T")

ReadBuf = bytes | mmap.mmap
PREAD_CHUNK = 4 * 1024 * 1024  # active-segment reads: big enough to amortise the syscall
_new = tuple.__new__  # Record(...) runs Python code per call; tuple.__new__ does not


class RecordBatch:
    """Events of ONE core from one frame, in LSN order, column by column.

    ``payload i`` is ``data[offsets[i]:offsets[i + 1]]``; ``offsets`` has
    ``len(self) + 1`` entries (the Arrow binary layout, so
    ``pyarrow.LargeBinaryArray.from_buffers`` can take it without copying).
    The sequence of event i is ``first_seq + i``.
    """

    __slots__ = ("core", "data", "first_seq", "lsns", "offsets")

    def __init__(
        self, core: int, lsns: array[int], first_seq: int, offsets: array[int], data: bytes
    ) -> None:
        self.core = core
        self.lsns = lsns  # array('Q'), ascending
        self.first_seq = first_seq
        self.offsets = offsets  # array('Q'), len(lsns) + 1 entries, offsets[0] == 0
        self.data = data

    def __len__(self) -> int:
        return len(self.lsns)

    def __repr__(self) -> str:
        if not self.lsns:
            return f"RecordBatch(core={self.core}, empty)"
        return (
            f"RecordBatch(core={self.core}, lsns={self.lsns[0]}..{self.lsns[-1]}, "
            f"events={len(self.lsns)}, bytes={len(self.data)})"
        )

    @property
    def seqs(self) -> range:
        return range(self.first_seq, self.first_seq + len(self.lsns))

    def payload(self, i: int) -> bytes:
        return self.data[self.offsets[i] : self.offsets[i + 1]]

    def payloads(self) -> list[bytes]:
        offs = self.offsets
        return list(map(self.data.__getitem__, map(slice, offs, islice(offs, 1, None))))

    def records(self) -> list[Record]:
        rows = zip(self.lsns, repeat(self.core, len(self)), self.seqs, self.payloads(), strict=True)
        return list(map(_new, repeat(Record), rows))


def _section_arrays(buf: ReadBuf, sec: Section) -> tuple[array[int], array[int], int]:
    deltas = decode_u32(buf, sec.body, sec.events)
    lens = decode_u32(buf, sec.body + ARRAY_ITEM * sec.events, sec.events)
    return deltas, lens, sec.body + 2 * ARRAY_ITEM * sec.events


def _bounds(deltas: array[int], first: int, lo: int, hi: int) -> tuple[int, int]:
    """Index range of the section's events with lo <= LSN <= hi (deltas ascend)."""
    return bisect_left(deltas, lo - first), bisect_right(deltas, hi - first)


def _payloads(buf: ReadBuf, lens: array[int], p0: int) -> Iterator[bytes]:
    offs = list(accumulate(lens, initial=p0))
    getitem: Any = buf.__getitem__  # bytes and mmap slices are both bytes copies
    return map(getitem, map(slice, offs, islice(offs, 1, None)))


def _section_records(
    buf: ReadBuf,
    sec: Section,
    first: int,
    deltas: array[int],
    lens: array[int],
    p0: int,
    a: int,
    b: int,
) -> Iterator[Record]:
    if a or b < sec.events:
        p0 += sum(lens[:a])
        lens = lens[a:b]
        deltas = deltas[a:b]
    lsns = map(first.__add__, deltas)
    seqs = range(sec.base_seq + a, sec.base_seq + b)
    rows = zip(lsns, repeat(sec.core, b - a), seqs, _payloads(buf, lens, p0), strict=True)
    return map(_new, repeat(Record), rows)


def frame_records(
    buf: ReadBuf, frame: Frame, core: int | None, lo: int, hi: int
) -> Iterator[Record]:
    """Records of ``frame`` with lo <= LSN <= hi, one core or all, in LSN order.

    Lazy: each Record is made when the caller takes it, so a replay never holds
    a frame's worth of objects (and the cyclic GC stays out of the way).
    """
    first = frame.first_lsn
    n = frame.events
    whole = lo <= first and hi >= first + n - 1
    if core is not None or len(frame.sections) <= 1:  # 0: a lost frame
        for sec in frame.sections:
            if core is None or sec.core == core:
                deltas, lens, p0 = _section_arrays(buf, sec)
                a, b = (0, sec.events) if whole else _bounds(deltas, first, lo, hi)
                return _section_records(buf, sec, first, deltas, lens, p0, a, b)
        return iter(())
    # Sections are per core; the frame's LSN order interleaves them. Scatter the
    # core, seq and payload columns to their LSN slots (C-level setitem per event).
    cores = [0] * n
    seqs = [0] * n
    payloads = [b""] * n
    for sec in frame.sections:
        deltas, lens, p0 = _section_arrays(buf, sec)
        deque(map(cores.__setitem__, deltas, repeat(sec.core)), 0)
        deque(map(seqs.__setitem__, deltas, range(sec.base_seq, sec.base_seq + sec.events)), 0)
        deque(map(payloads.__setitem__, deltas, _payloads(buf, lens, p0)), 0)
    a, b = (0, n) if whole else (max(lo - first, 0), min(hi - first + 1, n))
    if a or b < n:
        cores, seqs, payloads = cores[a:b], seqs[a:b], payloads[a:b]
    rows = zip(range(first + a, first + b), cores, seqs, payloads, strict=True)
    return map(_new, repeat(Record), rows)


def frame_batches(
    buf: ReadBuf, frame: Frame, core: int | None, lo: int, hi: int
) -> list[RecordBatch]:
    """One :class:`RecordBatch` per core section of ``frame`` (cores ascending)."""
    first = frame.first_lsn
    whole = lo <= first and hi >= first + frame.events - 1
    out: list[RecordBatch] = []
    for sec in frame.sections:
        if core is not None and sec.core != core:
            continue
        deltas, lens, p0 = _section_arrays(buf, sec)
        a, b = (0, sec.events) if whole else _bounds(deltas, first, lo, hi)
        if a >= b:
            continue
        if a or b < sec.events:
            p0 += sum(lens[:a])
            lens = lens[a:b]
            deltas = deltas[a:b]
        offsets = array("Q", accumulate(lens, initial=0))
        lsns = array("Q", map(first.__add__, deltas))
        out.append(
            RecordBatch(sec.core, lsns, sec.base_seq + a, offsets, buf[p0 : p0 + offsets[-1]])
        )
    return out


def segment_frames(
    seg: Segment, start_lsn: int, end: int, sealed: bool
) -> Iterator[tuple[ReadBuf, Frame]]:
    """Intact frames of ``seg`` below byte ``end``, from the one holding ``start_lsn``.

    Sealed segments are mapped (they never change again); the active one is
    read with ``pread`` and never past ``end``, the durable end the caller
    took: mapping a file that may still be cut would risk SIGBUS.
    """
    k = bisect_right(seg.frame_lsns, start_lsn) - 1
    offsets = seg.frame_offsets
    if not len(offsets) or end <= offsets[0]:
        return
    off = offsets[max(k, 0)] if max(k, 0) < len(offsets) else end
    if off >= end:
        return
    fd = os.open(seg.path, os.O_RDONLY)  # FileNotFoundError: retention removed it meanwhile
    if sealed:
        try:
            mm = mmap.mmap(fd, end, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        with mm:
            mm.madvise(mmap.MADV_SEQUENTIAL)
            while off < end:
                frame = check_frame(mm, off, end, seg.number)
                if isinstance(frame, str):
                    raise WalCorruptionError(frame, segment=seg.name, offset=off)
                yield mm, frame
                off += frame.size
        return
    try:
        yield from _pread_frames(fd, seg, off, end)
    finally:
        os.close(fd)


def _pread_frames(fd: int, seg: Segment, off: int, end: int) -> Iterator[tuple[ReadBuf, Frame]]:
    need = 0  # bytes the next read must hold: one frame can be bigger than a chunk
    while off < end:
        want = min(max(PREAD_CHUNK, need), end - off)
        buf = os.pread(fd, want, off)
        if len(buf) != want:
            raise WalReadError(f"{seg.name}: short read at offset {off} ({len(buf)} of {want})")
        local = 0
        need = 0
        while local < want:
            has_header = want - local >= FRAME_HEADER_SIZE
            size = FRAME_HEADER.unpack_from(buf, local)[4] if has_header else 0
            if (not has_header or local + size > want) and off + want < end:
                need = size  # the frame continues on disk: read again from its start
                break
            frame = check_frame(buf, local, want, seg.number)
            if isinstance(frame, str):
                raise WalCorruptionError(frame, segment=seg.name, offset=off + local)
            yield buf, frame
            local += frame.size
        off += local


class ReadIterator(chain[T]):
    """What :meth:`Wal.read` and :meth:`Wal.read_batches` return: a ``chain`` (so
    ``next`` runs in C) whose :meth:`close` releases the segment file at once."""

    __slots__ = ("_frames",)
    _frames: Generator[Iterable[T], None, None]

    @classmethod
    def over(cls, frames: Generator[Iterable[T], None, None]) -> ReadIterator[T]:
        it = cls.from_iterable(frames)
        assert isinstance(it, ReadIterator)
        it._frames = frames
        return it

    def close(self) -> None:
        """Release the open segment (fd / mmap). Do not iterate further afterwards."""
        self._frames.close()

    def __enter__(self) -> ReadIterator[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
