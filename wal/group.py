"""One group commit's pieces: the waiting appends, their sections, the frame's bytes.

:class:`wal.log.Wal`'s writer thread commits the appends that queued meanwhile
as one group, in these steps (``Wal._commit``):

1. Each :meth:`Wal.append` is a :class:`_Waiter`; its sections were checked on
   the caller's thread (:func:`_check_sections`).
2. The group's sections are merged per core (:func:`_merge`) and encoded into
   one frame; a frame encoded before a rotation is re-pointed at the new
   segment (:func:`_restamp`).
3. The frame is written (:func:`_pwrite_all`; a full volume raises
   ``OutOfSpace``, and :func:`_free_bytes` tells the error what is left).
4. After the fdatasync, each waiter is settled on its own loop or thread
   (:meth:`_Waiter.settle`) and the listener gets the group's events as one
   ``RecordBatch`` per core (:func:`_section_batches`).

Why a group commit: docs/wal.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
from array import array
from itertools import accumulate
from pathlib import Path
from typing import Any, Final

from wal.files import NO_SPACE, OutOfSpace
from wal.format import (
    FRAME_CRC_OFFSET,
    FRAME_CRC_START,
    EncodedFrame,
    EncodedSection,
    RequestTag,
    check_positions,
    crc32c,
)
from wal.reader import RecordBatch

_PER_EVENT_BYTES: Final = 8  # one u32 LSN delta + one u32 length per event


class _Waiter:
    """One append() call waiting for its group's fdatasync."""

    __slots__ = (
        "error",
        "event",
        "future",
        "n",
        "nbytes",
        "request",
        "result",
        "sections",
    )

    def __init__(
        self,
        n: int,
        sections: list[EncodedSection],
        future: asyncio.Future[tuple[int, int]] | None,
        event: threading.Event | None,
        request: RequestTag | None,
    ) -> None:
        self.n = n  # events
        self.sections = sections  # one per core, cores ascending; deltas from this append's start
        self.request = request
        self.nbytes = sum(len(s.blob) for s in sections) + _PER_EVENT_BYTES * n
        if request is not None:
            self.nbytes += len(request.key) + 32
        self.future = future
        self.event = event
        self.result: tuple[int, int] | None = None
        self.error: BaseException | None = None

    def settle(self, on_loop: asyncio.AbstractEventLoop | None) -> None:
        """Hand the result (or error) to whoever waits; ``on_loop``: the loop we run on, if any."""
        if self.event is not None:
            self.event.set()
            return
        fut = self.future
        if fut is None:
            return
        loop = fut.get_loop()
        if loop is on_loop:
            _settle_future(fut, self.result, self.error)
            return
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is waiting
            loop.call_soon_threadsafe(_settle_future, fut, self.result, self.error)


def _settle_future(
    fut: asyncio.Future[tuple[int, int]],
    result: tuple[int, int] | None,
    error: BaseException | None,
) -> None:
    if fut.done():  # the caller was cancelled; the events are durable all the same
        return
    if error is not None:
        fut.set_exception(error)
    else:
        assert result is not None
        fut.set_result(result)


def _check_sections(n: int, sections: list[EncodedSection]) -> None:
    """What :class:`CoreSections` promises: per section where that costs no pass
    per event, then the positions in one pass (:func:`check_positions`). Only
    the order of each section's positions is taken on trust."""
    if n < 1 or not sections:
        raise ValueError("append() needs at least one event")
    total = 0
    prev = -1
    for core, deltas, lens, blob in sections:
        k = len(deltas)
        if not isinstance(core, int) or not prev < core < 1 << 32:
            raise ValueError(f"append(): section cores must ascend in [0, 2**32), got {core!r}")
        if (
            not k
            or len(lens) != k
            or deltas.typecode != "I"
            or lens.typecode != "I"
            or deltas[0] < 0
            or deltas[-1] >= n
            or not isinstance(blob, bytes)
            or len(blob) != sum(lens)
        ):
            raise ValueError(f"append(): core {core}'s section is not a valid one of {n} events")
        total += k
        prev = core
    if total != n:
        raise ValueError(f"append(): the sections hold {total} events, not {n}")
    why = check_positions(sections, n)  # the one pass per event (~2-20 ns)
    if why is not None:
        raise ValueError(f"append(): {why}")


def _merge(group: list[_Waiter]) -> list[EncodedSection]:
    """The group's sections, per core: each append's deltas moved to its place
    in the group, lengths and payloads concatenated (C-level, per core)."""
    by_core: dict[int, list[tuple[int, EncodedSection]]] = {}
    base = 0
    for w in group:
        for sec in w.sections:
            by_core.setdefault(sec.core, []).append((base, sec))
        base += w.n
    out: list[EncodedSection] = []
    for core in sorted(by_core):
        runs = by_core[core]
        if len(runs) == 1:
            base, sec = runs[0]
            if base:
                sec = sec._replace(deltas=array("I", map(base.__add__, sec.deltas)))
            out.append(sec)
            continue
        deltas = array("I")
        lens = array("I")
        for base, sec in runs:
            deltas.extend(map(base.__add__, sec.deltas) if base else sec.deltas)
            lens.extend(sec.lens)
        out.append(EncodedSection(core, deltas, lens, b"".join(sec.blob for _, sec in runs)))
    return out


def _section_batches(first: int, frame: EncodedFrame) -> list[RecordBatch]:
    """The group's events as one RecordBatch per core, from the encoded sections.

    The per-event work is two C-level passes (LSNs, offsets); the payload bytes
    are the section's blob, already joined for the write.
    """
    out: list[RecordBatch] = []
    base_seqs = frame.base_seqs
    for core, deltas, lens, blob in frame.sections:
        k = len(deltas)
        if deltas[-1] == k - 1:  # deltas ascend from >= 0: the section is 0 .. k-1
            lsns = array("Q", range(first, first + k))
        else:
            lsns = array("Q", map(first.__add__, deltas))
        offsets = array("Q", accumulate(lens, initial=0))
        out.append(RecordBatch(core, lsns, base_seqs[core], offsets, blob))
    return out


def _pwrite_all(fd: int, parts: list[Any], offset: int, size: int) -> None:
    """Write ``parts`` at ``offset``; ENOSPC / EDQUOT raise :class:`OutOfSpace`."""
    try:
        written = os.pwritev(fd, parts, offset) if len(parts) < 1024 else 0
        if written == size:
            return
        # A short write (a filling volume, a signal): the next call fails or goes on.
        data = memoryview(b"".join(parts))
        while written < size:
            n = os.pwrite(fd, data[written:], offset + written)
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite wrote {n} bytes at offset {offset + written}")
            written += n
    except OSError as exc:
        if exc.errno in NO_SPACE:
            raise OutOfSpace(exc.errno, exc.strerror) from exc
        raise


def _free_bytes(directory: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``directory``'s volume (None: unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _restamp(parts: list[Any], segment_no: int) -> None:
    """Point an encoded frame at another segment (rotation decided after encoding)."""
    head = parts[0]
    head[FRAME_CRC_START + 4 : FRAME_CRC_START + 8] = segment_no.to_bytes(4, "little")
    crc = crc32c(memoryview(head)[FRAME_CRC_START:])
    for part in parts[1:]:
        crc = crc32c(part, crc)
    head[FRAME_CRC_OFFSET : FRAME_CRC_OFFSET + 4] = crc.to_bytes(4, "little")
