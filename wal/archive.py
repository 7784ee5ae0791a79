"""The WAL archive's object format: whole WAL frames, with their LSN range and checksums.

An archive object (docs/wal.md, "The archive") is an 80-byte header followed by
a body of whole frames exactly as the WAL wrote them (each still carries its
own CRC32C, docs/wal.md, "Frame"). The header says which WAL and which writer
epoch made it, its number (objects are named by number, contiguously), the
LSN range the body covers and a CRC32C of the body; a second CRC covers the
header. A *fence* object has no body: a new holder of the archive writes one
at the next name, so that the old holder's next create-only upload there fails.

This module is pure: no I/O, no S3. The uploader is ``daemon/walarchive.py``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from wal.format import FRAME_HEADER, FRAME_HEADER_SIZE, check_frame, crc32c

OBJECT_MAGIC: Final = b"EPWALARC"
OBJECT_VERSION: Final = 1
KIND_DATA: Final = 0
KIND_FENCE: Final = 1
OBJECT_HEADER: Final = struct.Struct(
    "<"
    "8s"  # magic: OBJECT_MAGIC
    "H"  # version: OBJECT_VERSION
    "H"  # kind: KIND_DATA | KIND_FENCE
    "I"  # frames in the body
    "16s"  # the WAL id (IDENTITY's uuid)
    "Q"  # epoch of the holder that wrote it (the manifest's)
    "Q"  # object number (its name)
    "Q"  # first LSN of the body (a fence: the archive's last LSN + 1)
    "Q"  # last LSN of the body (a fence: the archive's last LSN)
    "Q"  # body length in bytes
    "I"  # CRC32C of the body
)
OBJECT_HEADER_SIZE: Final = OBJECT_HEADER.size + 4  # + CRC32C of the header: 80


class ArchiveFormatError(ValueError):
    """An archive object that is not intact."""


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    kind: int
    frames: int
    wal_id: str  # hex
    epoch: int
    number: int
    first_lsn: int
    last_lsn: int
    body_len: int
    body_crc: int

    @property
    def fence(self) -> bool:
        return self.kind == KIND_FENCE


def object_name(number: int) -> str:
    """An object's name under the archive's ``wal/`` prefix: name order is number order."""
    return f"{number:020d}"


def encode_object(
    wal_id: str,
    epoch: int,
    number: int,
    first_lsn: int,
    last_lsn: int,
    frames: list[bytes],
    *,
    kind: int = KIND_DATA,
) -> list[bytes]:
    """The object's bytes, as parts (header first) to join or stream."""
    crc = 0
    size = 0
    for f in frames:
        crc = crc32c(f, crc)
        size += len(f)
    head = OBJECT_HEADER.pack(
        OBJECT_MAGIC,
        OBJECT_VERSION,
        kind,
        len(frames),
        bytes.fromhex(wal_id),
        epoch,
        number,
        first_lsn,
        last_lsn,
        size,
        crc,
    )
    return [head + crc32c(head).to_bytes(4, "little"), *frames]


def encode_fence(wal_id: str, epoch: int, number: int, archived_lsn: int) -> bytes:
    return b"".join(
        encode_object(wal_id, epoch, number, archived_lsn + 1, archived_lsn, [], kind=KIND_FENCE)
    )


def parse_header(buf: bytes) -> ObjectHeader:
    """The header of an object (its first :data:`OBJECT_HEADER_SIZE` bytes), checked."""
    if len(buf) < OBJECT_HEADER_SIZE:
        raise ArchiveFormatError(f"object shorter than its header ({len(buf)} bytes)")
    raw = buf[: OBJECT_HEADER.size]
    stored = int.from_bytes(buf[OBJECT_HEADER.size : OBJECT_HEADER_SIZE], "little")
    if crc32c(raw) != stored:
        raise ArchiveFormatError("object header CRC mismatch")
    magic, version, kind, frames, wal_id, epoch, number, first, last, size, crc = (
        OBJECT_HEADER.unpack(raw)
    )
    if magic != OBJECT_MAGIC or version != OBJECT_VERSION:
        raise ArchiveFormatError(f"not an archive object (magic {magic!r}, version {version})")
    return ObjectHeader(kind, frames, wal_id.hex(), epoch, number, first, last, size, crc)


def parse_object(buf: bytes) -> tuple[ObjectHeader, list[tuple[int, int, bytes]]]:
    """Check a whole object: the header, the body's CRC, then every frame (its
    own CRC, LSNs contiguous over exactly the header's range). Returns the
    header and ``(first_lsn, events, frame bytes)`` per frame."""
    head = parse_header(buf)
    body = memoryview(buf)[OBJECT_HEADER_SIZE:]
    if len(body) != head.body_len:
        raise ArchiveFormatError(f"body of {len(body)} bytes, the header says {head.body_len}")
    if crc32c(body) != head.body_crc:
        raise ArchiveFormatError(f"object {head.number}: body CRC mismatch")
    frames = list(_frames(buf, OBJECT_HEADER_SIZE, len(buf)))
    if len(frames) != head.frames:
        raise ArchiveFormatError(f"{len(frames)} frames, the header says {head.frames}")
    lsn = head.first_lsn
    for first, events, _ in frames:
        if first != lsn:
            raise ArchiveFormatError(f"object {head.number}: frame at LSN {first}, expected {lsn}")
        lsn += events
    if lsn != head.last_lsn + 1:
        raise ArchiveFormatError(
            f"object {head.number}: frames end at LSN {lsn - 1}, the header says {head.last_lsn}"
        )
    return head, frames


def _frames(buf: bytes, off: int, end: int) -> Iterator[tuple[int, int, bytes]]:
    while off < end:
        if end - off < FRAME_HEADER_SIZE:
            raise ArchiveFormatError(f"a torn frame header at byte {off}")
        stamp = FRAME_HEADER.unpack_from(buf, off)[5]
        frame = check_frame(buf, off, end, stamp)
        if isinstance(frame, str):
            raise ArchiveFormatError(f"frame at byte {off}: {frame}")
        yield frame.first_lsn, frame.events, bytes(buf[off : off + frame.size])
        off += frame.size
