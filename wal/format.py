"""Byte layout of WAL segments and frames, and the pure functions that encode and check them.

A segment file is one segment header followed by frames, back to back, no padding::

    +----------------+---------+---------+-----+---------+
    | segment header | frame 1 | frame 2 | ... | frame k |
    +----------------+---------+---------+-----+---------+

One frame holds one group commit (every append the writer thread coalesced
between two fdatasyncs). Inside a frame the events are grouped by core, one
*section* per core present, in ascending core order::

    frame header | section(core a) | section(core b) | ...
    section      = section header | LSN deltas | payload lengths | payloads

A frame whose header has the ``FLAG_REQUESTS`` flag ends with a *request
table* after the last section: the idempotency keys of the appends in the
frame that carried one (docs/ingest.md, "Idempotent requests")::

    request table = table header | entry | entry | ...
    entry         = entry header | key bytes

A one-core reader reads the section header, compares the core and jumps
``body_len`` bytes ahead when it is another core's: no decoding of the other
cores' arrays or payloads; readers of events never look at the request table.
The LSN deltas (``array('I')``, relative to the frame's first LSN) say where
each event sits in the frame's LSN order; the per-core sequence of the i-th
event of a section is ``base_seq + i``.

Integers are little-endian. Every check returns a reason string instead of
raising, so recovery, ``verify`` and ``repair`` can decide what a failure
means (torn tail or corruption) at the place where that is known.
"""

from __future__ import annotations

import mmap
import re
import struct
import sys
from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import pairwise
from operator import itemgetter
from typing import Final, NamedTuple, overload

import crc32c as _crc32c

from wal.errors import WalError

FORMAT_VERSION: Final = 1

# ---------------------------------------------------------------------------
# Segment header: written and fsynced (file, then directory) before any frame.
# The CRC covers bytes [0, SEGMENT_CRC_OFFSET).
SEGMENT_MAGIC: Final = b"EPWALSEG"
SEGMENT_HEADER: Final = struct.Struct(
    "<"
    "8s"  # magic: SEGMENT_MAGIC
    "H"  # format version: FORMAT_VERSION
    "H"  # flags: 0, reserved
    "I"  # reserved: 0
    "16s"  # wal_id: the 16 bytes of the WAL's uuid4 (IDENTITY holds the hex form)
    "Q"  # segment number: 1 for the first segment of a WAL, +1 per rotation
    "Q"  # first LSN of the segment; also the file name
    "I"  # CRC32C of the bytes before this field
    "12x"  # padding, so frames start at a 64-byte offset
)
SEGMENT_CRC_OFFSET: Final = struct.calcsize("<8sHHI16sQQ")
SEGMENT_HEADER_SIZE: Final = SEGMENT_HEADER.size  # 64

# ---------------------------------------------------------------------------
# Frame header. The CRC covers bytes [FRAME_CRC_START, frame_len) of the frame:
# the rest of this header (so frame_len itself is covered) and every section.
# magic and version are checked by value; a torn or stale frame fails the CRC.
FRAME_MAGIC: Final = 0xE9F7
FRAME_HEADER: Final = struct.Struct(
    "<"
    "H"  # magic: FRAME_MAGIC
    "B"  # format version: FORMAT_VERSION
    "B"  # flags: FLAG_REQUESTS, FLAG_LOST or 0
    "I"  # crc: CRC32C of frame bytes [FRAME_CRC_START, frame_len)
    "I"  # frame_len: bytes of the whole frame, this header included
    "I"  # segment number stamp: bytes left over from another segment never pass
    "Q"  # first LSN: LSNs of the frame are first_lsn .. first_lsn + count - 1
    "I"  # count: events in the frame (>= 1)
    "H"  # sections: number of core sections (>= 1; 0 in a lost frame)
    "H"  # reserved: 0
)
FRAME_CRC_OFFSET: Final = struct.calcsize("<HBB")
FRAME_CRC_START: Final = struct.calcsize("<HBBI")
FRAME_HEADER_SIZE: Final = FRAME_HEADER.size  # 32
FRAME_PREFIX: Final = struct.pack("<HB", FRAME_MAGIC, FORMAT_VERSION)  # what a scan looks for
MAX_FRAME_BYTES: Final = 0xFFFF_FFFF  # frame_len is a u32

# ---------------------------------------------------------------------------
# Section header, followed by ``count`` u32 LSN deltas, ``count`` u32 payload
# lengths and the payloads concatenated in LSN order.
SECTION_HEADER: Final = struct.Struct(
    "<"
    "Q"  # base_seq: per-core sequence of the section's first event; +1 per event
    "I"  # core
    "I"  # count: events of this core in the frame (>= 1)
    "I"  # body_len: bytes after this header = 8 * count + sum(payload lengths)
)
SECTION_HEADER_SIZE: Final = SECTION_HEADER.size  # 20
ARRAY_ITEM: Final = 4  # bytes per LSN delta and per payload length

# ---------------------------------------------------------------------------
# Request table (frames with FLAG_REQUESTS): after the sections, up to frame_len.
FLAG_REQUESTS: Final = 0x01
REQUEST_TABLE_HEADER: Final = struct.Struct(
    "<"
    "Q"  # written at: Unix time in milliseconds (the writer's clock), for the window's age
    "I"  # entries (>= 1)
)
REQUEST_ENTRY: Final = struct.Struct(
    "<"
    "I"  # first LSN delta: the append's first event, relative to the frame's first LSN
    "I"  # events of the append (>= 1); its LSNs are consecutive
    "H"  # key length in bytes (>= 1); the key follows this header
    "16s"  # digest of the request, opaque to the WAL (ingest: what the body was)
)
MAX_REQUEST_KEY_BYTES: Final = 0xFFFF

# ---------------------------------------------------------------------------
# A lost frame (FLAG_LOST) is a frame header alone: ``count`` LSNs from
# ``first_lsn`` that this WAL no longer holds, with no section. A restore
# writes one when tables committed LSNs the archive never got (``ack =
# "local"``, docs/operating.md, "Losing the machine"): the WAL's LSNs stay
# contiguous, new events go on above them, and readers see no event there.
FLAG_LOST: Final = 0x02
MAX_LOST_PER_FRAME: Final = 0xFFFF_FFFF  # count is a u32

SEGMENT_NAME_RE: Final = re.compile(r"^(\d{20})\.wal$")

Buf = bytes | bytearray | memoryview | mmap.mmap  # anything struct and crc32c read in place

if array("I").itemsize != ARRAY_ITEM:  # pragma: no cover - every CPython platform we target
    raise ImportError("wal.format needs a 4-byte array('I')")
_SWAP: Final = sys.byteorder != "little"


def crc32c(data: Buf | array[int], value: int = 0) -> int:
    """CRC32C (Castagnoli); hardware accelerated, releases the GIL for large buffers."""
    return int(_crc32c.crc32c(data, value))


def segment_name(first_lsn: int) -> str:
    return f"{first_lsn:020d}.wal"


# ---------------------------------------------------------------------------
# Segment header


def encode_segment_header(wal_id: bytes, number: int, first_lsn: int) -> bytes:
    head = bytearray(
        SEGMENT_HEADER.pack(SEGMENT_MAGIC, FORMAT_VERSION, 0, 0, wal_id, number, first_lsn, 0)
    )
    struct.pack_into("<I", head, SEGMENT_CRC_OFFSET, crc32c(head[:SEGMENT_CRC_OFFSET]))
    return bytes(head)


class SegmentHeader(NamedTuple):
    wal_id: bytes
    number: int
    first_lsn: int


def parse_segment_header(buf: bytes) -> SegmentHeader | str:
    """The header, or the reason it is not one."""
    if len(buf) < SEGMENT_HEADER_SIZE:
        return f"segment header truncated: {len(buf)} of {SEGMENT_HEADER_SIZE} bytes"
    magic, version, _flags, _res, wal_id, number, first_lsn, crc = SEGMENT_HEADER.unpack_from(buf)
    if magic != SEGMENT_MAGIC:
        return f"bad segment magic {bytes(magic)!r}"
    actual = crc32c(buf[:SEGMENT_CRC_OFFSET])
    if crc != actual:
        return f"segment header CRC mismatch (stored {crc:#010x}, computed {actual:#010x})"
    if version != FORMAT_VERSION:
        return f"unsupported segment format version {version} (this build reads {FORMAT_VERSION})"
    return SegmentHeader(bytes(wal_id), number, first_lsn)


# ---------------------------------------------------------------------------
# Frames


class RequestTag(NamedTuple):
    """What an append may carry besides its events: an idempotency key and a digest."""

    key: bytes  # 1 .. MAX_REQUEST_KEY_BYTES bytes
    digest: bytes  # exactly 16 bytes


class RequestEntry(NamedTuple):
    """One request of a request table, with absolute LSNs."""

    key: bytes
    digest: bytes
    first_lsn: int
    last_lsn: int
    written_ms: int


def encode_request_table(written_ms: int, tagged: list[tuple[int, int, RequestTag]]) -> bytes:
    """``tagged``: (first LSN delta, events, tag) per tagged append of the frame."""
    out = bytearray(REQUEST_TABLE_HEADER.pack(written_ms, len(tagged)))
    for delta, events, tag in tagged:
        out += REQUEST_ENTRY.pack(delta, events, len(tag.key), tag.digest)
        out += tag.key
    return bytes(out)


class EncodedSection(NamedTuple):
    """One core's events of an encoded frame, in LSN order (native byte order)."""

    core: int
    deltas: array[int]  # LSN - frame's first LSN, ascending
    lens: array[int]  # payload lengths
    blob: bytes  # the payloads, concatenated (the bytes the frame holds)


class EncodedFrame(NamedTuple):
    parts: list[bytes | bytearray | array[int]]  # write these in order (os.pwritev)
    size: int  # frame_len
    base_seqs: dict[int, int]  # core -> seq of its first event in this frame
    # The sections, cores ascending: what the WAL's columnar listener is built
    # from (``Wal.set_listener(..., batches=True)``) without a pass per event.
    sections: list[EncodedSection]


def sections_of(cores: list[int], payloads: list[bytes], lens: array[int]) -> list[EncodedSection]:
    """``(core, payload)`` columns in LSN order as one section per core, cores ascending.

    The work is a stable sort of the event indices by core plus C-level
    gathers: no Python code runs per event.
    """
    n = len(cores)
    if cores.count(cores[0]) == n:  # one core: the frame order is the section order
        return [EncodedSection(cores[0], array("I", range(n)), lens, b"".join(payloads))]
    sections: list[EncodedSection] = []
    # A stable sort of the indices by core, then per core a C-level gather.
    # (Measured: ~2x cheaper than Counter + index-based length gathers.)
    key = cores.__getitem__
    order = sorted(range(n), key=key)
    pos = 0
    while pos < n:
        core = key(order[pos])
        end = bisect_right(order, core, lo=pos, key=key)
        idx = order[pos:end]
        chosen = list(map(payloads.__getitem__, idx))
        sections.append(
            EncodedSection(core, array("I", idx), array("I", map(len, chosen)), b"".join(chosen))
        )
        pos = end
    return sections


# Below this many events check_positions marks them in a bytearray (~0.3 us
# per call plus ~18 ns per event); from it on numpy's bincount (~1.2-1.7 us per
# call plus ~2 ns per event) is cheaper. Measured crossover: 55-75 events.
_NUMPY_FROM: Final = 64
_deltas_of = itemgetter(1)


def check_positions(sections: Sequence[EncodedSection], n: int) -> str | None:
    """Why the sections' ``deltas`` are not a permutation of ``0 .. n - 1``
    (each position named by exactly one event), or None when they are.

    ``CoreSections`` promises it; ``Wal.append`` checks it after the promises
    it checks per section. Ingest makes one per request, so this is the
    cheapest pass that holds: ``n`` positions in all, every one in range and
    none left out means none is named twice.
    """
    if n < _NUMPY_FROM:
        seen = bytearray(n)
        total = 0
        try:
            for sec in sections:
                deltas = sec.deltas
                total += len(deltas)
                for d in deltas:
                    seen[d] = 1  # IndexError past n - 1
            ok = total == n and 0 not in seen
        except IndexError:
            ok = False
    else:
        import numpy as np  # here: the WAL's readers and tools do not need it

        joined = sections[0].deltas if len(sections) == 1 else b"".join(map(_deltas_of, sections))
        positions = np.frombuffer(joined, np.uint32)
        counts = np.bincount(positions, minlength=n)
        ok = positions.size == n and counts.size == n and int(np.count_nonzero(counts)) == n
    return None if ok else _positions_fault(sections, n)


def _positions_fault(sections: Sequence[EncodedSection], n: int) -> str:
    """What :func:`check_positions` found, and where (its slow path)."""
    total = sum(len(sec.deltas) for sec in sections)
    if total != n:
        return f"the sections name {total} positions, not {n}"
    owners: dict[int, list[int]] = {}
    for sec in sections:
        for d in sec.deltas:
            owners.setdefault(d, []).append(sec.core)
    past = [d for d in owners if d >= n]
    if past:
        d = min(past)
        return f"core {owners[d][0]}'s section names position {d}, past the last ({n - 1})"
    twice = min(d for d, cores in owners.items() if len(cores) > 1)
    missing = min(set(range(n)) - owners.keys())
    named = " and ".join(map(str, owners[twice]))
    return (
        f"position {twice} of 0 .. {n - 1} is named {len(owners[twice])} times"
        f" (cores {named}) and position {missing} by no section"
    )


class CoreSections(Sequence[tuple[int, bytes]]):
    """An append's events already split by core: what ingest hands ``Wal.append``.

    As a sequence it reads as the ``(core, payload)`` items in request (LSN)
    order, built on first use, so anything that takes items takes it; the WAL
    takes :attr:`sections` as they are, without a pass per event
    (``wal.log.Wal._enqueue``). The maker guarantees that :attr:`sections`
    come cores ascending, each with ascending ``deltas`` (the events'
    positions in the append, together exactly ``0 .. n - 1``), ``lens`` of
    the same length and the payloads concatenated in ``blob``; ``Wal.append``
    checks all but the ascending order (``wal.log._check_sections``).
    """

    __slots__ = ("_items", "n", "sections")

    def __init__(self, sections: list[EncodedSection], n: int) -> None:
        self.sections = sections
        self.n = n
        self._items: list[tuple[int, bytes]] | None = None

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return iter(self.items())

    @overload
    def __getitem__(self, index: int) -> tuple[int, bytes]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[int, bytes]]: ...

    def __getitem__(self, index: int | slice) -> tuple[int, bytes] | Sequence[tuple[int, bytes]]:
        return self.items()[index]

    def items(self) -> list[tuple[int, bytes]]:
        if self._items is None:
            hole = (-1, b"")
            out = [hole] * self.n
            for core, deltas, lens, blob in self.sections:
                pos = 0
                for d, k in zip(deltas, lens, strict=True):
                    out[d] = (core, blob[pos : pos + k])
                    pos += k
            if any(x is hole for x in out):
                raise WalError("CoreSections: the sections' deltas do not cover 0 .. n - 1")
            self._items = out
        return self._items


def encode_frame(
    segment_no: int,
    first_lsn: int,
    cores: list[int],
    payloads: list[bytes],
    lens: array[int],
    next_seq: dict[int, int],
    requests: bytes = b"",
) -> EncodedFrame:
    """:func:`encode_sections` of ``cores``, ``payloads`` and ``lens`` (payload
    lengths), parallel columns in LSN order (:func:`sections_of`)."""
    return encode_sections(
        segment_no, first_lsn, len(cores), sections_of(cores, payloads, lens), next_seq, requests
    )


def encode_sections(
    segment_no: int,
    first_lsn: int,
    n: int,
    sections: list[EncodedSection],
    next_seq: dict[int, int],
    requests: bytes = b"",
) -> EncodedFrame:
    """Encode one group of ``n`` events, given as sections (cores ascending), as one
    frame. ``next_seq`` (core -> next sequence) is advanced.

    ``requests`` is the group's request table (:func:`encode_request_table`),
    or empty for a frame without one.
    """
    parts: list[bytes | bytearray | array[int]] = [b""]  # the header goes first, once known
    base_seqs: dict[int, int] = {}
    size = FRAME_HEADER_SIZE
    for core, deltas, lengths, blob in sections:
        if _SWAP:  # pragma: no cover - big-endian hosts (the sections keep native order)
            deltas = array("I", deltas)
            deltas.byteswap()
            lengths = array("I", lengths)
            lengths.byteswap()
        count = len(deltas)
        base = next_seq.get(core, 1)
        next_seq[core] = base + count
        base_seqs[core] = base
        body_len = 2 * ARRAY_ITEM * count + len(blob)
        parts += (SECTION_HEADER.pack(base, core, count, body_len), deltas, lengths, blob)
        size += SECTION_HEADER_SIZE + body_len
    flags = 0
    if requests:
        parts.append(requests)
        size += len(requests)
        flags = FLAG_REQUESTS
    if size > MAX_FRAME_BYTES:
        raise WalError(f"one group of {n} events needs {size} bytes; a frame holds at most 4 GiB")
    head = bytearray(
        FRAME_HEADER.pack(
            FRAME_MAGIC, FORMAT_VERSION, flags, 0, size, segment_no, first_lsn, n, len(sections), 0
        )
    )
    crc = crc32c(memoryview(head)[FRAME_CRC_START:])
    for part in parts[1:]:
        crc = crc32c(part, crc)
    struct.pack_into("<I", head, FRAME_CRC_OFFSET, crc)
    parts[0] = head
    return EncodedFrame(parts, size, base_seqs, sections)


class Section(NamedTuple):
    core: int
    events: int
    base_seq: int
    body: int  # absolute offset of the LSN deltas (right after the section header)
    body_len: int


class Frame(NamedTuple):
    offset: int
    size: int
    first_lsn: int
    events: int
    sections: list[Section]
    requests: int = 0  # absolute offset of the request table; 0 when the frame has none
    lost: bool = False  # a lost frame: its LSNs hold no event (FLAG_LOST)


def check_frame(
    buf: Buf, offset: int, limit: int, segment_no: int, *, check_crc: bool = True
) -> Frame | str:
    """Parse and check the frame at ``offset`` (``limit`` = end of readable bytes).

    Returns the frame or the reason it is not a whole, intact frame of this
    segment. Checks: header bounds, magic, version, length, segment stamp, CRC,
    and that the section headers tile the frame exactly with ascending cores
    and counts summing to the frame's count, and that a request table (if the
    flag says there is one) fills the rest of the frame exactly. Per-event
    checks live in :func:`check_frame_deep`.
    """
    avail = limit - offset
    if avail < FRAME_HEADER_SIZE:
        return f"truncated frame header: {avail} of {FRAME_HEADER_SIZE} bytes"
    magic, version, flags, crc, size, stamp, first_lsn, count, nsec, _res = (
        FRAME_HEADER.unpack_from(buf, offset)
    )
    if magic != FRAME_MAGIC:
        return f"bad frame magic {magic:#06x} (expected {FRAME_MAGIC:#06x})"
    if version != FORMAT_VERSION:
        return f"unsupported frame format version {version}"
    if flags == FLAG_LOST:
        return _check_lost_frame(buf, offset, size, crc, stamp, segment_no, check_crc)
    if size < FRAME_HEADER_SIZE + SECTION_HEADER_SIZE:
        return f"frame length {size} is below the minimum"
    if size > avail:
        return f"frame length {size} runs past the end of the data ({avail} bytes left)"
    why = _check_whole(buf, offset, size, crc, stamp, segment_no, check_crc)
    if why is not None:
        return why
    if count < 1 or nsec < 1:
        return f"frame with {count} events in {nsec} sections"
    sections: list[Section] = []
    pos = offset + FRAME_HEADER_SIZE
    end = offset + size
    total = 0
    last_core = -1
    for _ in range(nsec):
        if end - pos < SECTION_HEADER_SIZE:
            return f"section header at offset {pos} runs past the frame end"
        base_seq, core, scount, body_len = SECTION_HEADER.unpack_from(buf, pos)
        body = pos + SECTION_HEADER_SIZE
        if core <= last_core:
            return f"section of core {core} after core {last_core} (cores must ascend)"
        if scount < 1 or body_len < 2 * ARRAY_ITEM * scount or body + body_len > end:
            return f"section of core {core} at offset {pos}: count {scount}, length {body_len}"
        sections.append(Section(core, scount, base_seq, body, body_len))
        total += scount
        last_core = core
        pos = body + body_len
    if total != count:
        return f"sections hold {total} events, the frame header says {count}"
    if flags & ~FLAG_REQUESTS:
        return f"unknown frame flags {flags:#04x}"  # FLAG_LOST only alone, checked above
    table = 0
    if flags & FLAG_REQUESTS:
        table = pos
        why = _check_request_table(buf, pos, end)
        if why is not None:
            return why
    elif pos != end:
        return f"sections end at offset {pos}, the frame at {end}"
    return Frame(offset, size, first_lsn, count, sections, table)


def _check_whole(
    buf: Buf, offset: int, size: int, crc: int, stamp: int, segment_no: int, check_crc: bool
) -> str | None:
    """Why the frame's bytes are not the ones written for this segment (CRC, stamp)."""
    if check_crc:
        actual = crc32c(memoryview(buf)[offset + FRAME_CRC_START : offset + size])
        if actual != crc:
            return f"frame CRC mismatch (stored {crc:#010x}, computed {actual:#010x}, {size} bytes)"
    if stamp != segment_no:
        return f"frame carries segment stamp {stamp}, this is segment {segment_no} (stale bytes)"
    return None


def _check_lost_frame(
    buf: Buf, offset: int, size: int, crc: int, stamp: int, segment_no: int, check_crc: bool
) -> Frame | str:
    # The caller checked that the header is readable: a lost frame is no more.
    if size != FRAME_HEADER_SIZE:
        return f"lost frame of length {size} (a lost frame is its header alone)"
    why = _check_whole(buf, offset, size, crc, stamp, segment_no, check_crc)
    if why is not None:
        return why
    first_lsn, count, nsec = FRAME_HEADER.unpack_from(buf, offset)[6:9]
    if count < 1 or nsec != 0:
        return f"lost frame of {count} LSNs with {nsec} sections"
    return Frame(offset, size, first_lsn, count, [], 0, lost=True)


def encode_lost_frame(segment_no: int, first_lsn: int, count: int) -> bytes:
    """The lost frame for LSNs ``first_lsn .. first_lsn + count - 1``."""
    if not 1 <= count <= MAX_LOST_PER_FRAME:
        raise WalError(f"a lost frame covers 1 to {MAX_LOST_PER_FRAME} LSNs, not {count}")
    head = bytearray(
        FRAME_HEADER.pack(
            FRAME_MAGIC,
            FORMAT_VERSION,
            FLAG_LOST,
            0,
            FRAME_HEADER_SIZE,
            segment_no,
            first_lsn,
            count,
            0,
            0,
        )
    )
    struct.pack_into("<I", head, FRAME_CRC_OFFSET, crc32c(memoryview(head)[FRAME_CRC_START:]))
    return bytes(head)


def _check_request_table(buf: Buf, pos: int, end: int) -> str | None:
    if end - pos < REQUEST_TABLE_HEADER.size:
        return f"request table at offset {pos} runs past the frame end"
    _written, entries = REQUEST_TABLE_HEADER.unpack_from(buf, pos)
    if entries < 1:
        return f"request table at offset {pos} with no entry"
    pos += REQUEST_TABLE_HEADER.size
    for _ in range(entries):
        if end - pos < REQUEST_ENTRY.size:
            return f"request entry at offset {pos} runs past the frame end"
        key_len = REQUEST_ENTRY.unpack_from(buf, pos)[2]
        pos += REQUEST_ENTRY.size + key_len
    if pos != end:
        return f"request table ends at offset {pos}, the frame at {end}"
    return None


def frame_requests(buf: Buf, frame: Frame) -> list[RequestEntry]:
    """The request table of a checked frame (empty when it has none)."""
    if not frame.requests:
        return []
    pos = frame.requests
    written, entries = REQUEST_TABLE_HEADER.unpack_from(buf, pos)
    pos += REQUEST_TABLE_HEADER.size
    out: list[RequestEntry] = []
    first = frame.first_lsn
    for _ in range(entries):
        delta, events, key_len, digest = REQUEST_ENTRY.unpack_from(buf, pos)
        pos += REQUEST_ENTRY.size
        key = bytes(buf[pos : pos + key_len])
        pos += key_len
        lsn = first + delta
        out.append(RequestEntry(key, bytes(digest), lsn, lsn + events - 1, written))
    return out


def decode_u32(buf: Buf, start: int, count: int) -> array[int]:
    out = array("I")
    out.frombytes(memoryview(buf)[start : start + ARRAY_ITEM * count])
    if _SWAP:  # pragma: no cover - big-endian hosts
        out.byteswap()
    return out


def check_frame_deep(buf: Buf, frame: Frame) -> str | None:
    """Per-event checks (``wal verify``): deltas and lengths agree with the frame."""
    if frame.lost:
        return None  # a header alone, checked whole by check_frame
    seen: list[int] = []
    for sec in frame.sections:
        deltas = decode_u32(buf, sec.body, sec.events)
        lengths = decode_u32(buf, sec.body + ARRAY_ITEM * sec.events, sec.events)
        if sum(lengths) != sec.body_len - 2 * ARRAY_ITEM * sec.events:
            return f"core {sec.core}: payload lengths do not add up to the section length"
        if any(a >= b for a, b in pairwise(deltas)):
            return f"core {sec.core}: LSN deltas are not strictly increasing"
        seen += deltas
    if sorted(seen) != list(range(frame.events)):
        return "the sections' LSN deltas do not cover the frame's LSNs exactly once"
    last = frame.first_lsn - 1
    for req in frame_requests(buf, frame):
        if not req.key or req.first_lsn <= last or req.last_lsn < req.first_lsn:
            return f"request table: entry for LSNs {req.first_lsn}..{req.last_lsn} out of order"
        last = req.last_lsn
    if last >= frame.first_lsn + frame.events:
        return f"request table names LSN {last}, past the frame's last"
    return None


def find_frame_after(
    buf: bytes | mmap.mmap, start: int, limit: int, segment_no: int, min_lsn: int
) -> Frame | None:
    """First intact frame of this segment carrying LSNs >= ``min_lsn`` at any offset >= start.

    Recovery uses it to tell a torn tail (nothing valid after the damage) from
    damage in the middle of the log (valid frames follow: acknowledged data).
    """
    pos = buf.find(FRAME_PREFIX, start, limit)
    while pos >= 0:
        found = check_frame(buf, pos, limit, segment_no)
        if isinstance(found, Frame) and found.first_lsn >= min_lsn:
            return found
        pos = buf.find(FRAME_PREFIX, pos + 1, limit)
    return None
