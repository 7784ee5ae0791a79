"""The de-duplication window (wal/requests.py): request keys written with their events,
found before the append returns, rebuilt on open, kept across retention, bounded."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
import structlog

from tests.wal.helpers import OpenWal, events
from wal import Wal
from wal.format import FLAG_REQUESTS, FRAME_HEADER, SEGMENT_HEADER_SIZE, RequestEntry, RequestTag
from wal.requests import SNAPSHOT, RequestWindow
from wal.segments import scan
from wal.tool import verify

WINDOW = {"request_window_s": 3600.0, "request_max_keys": 1000}


def tag(name: str) -> RequestTag:
    return RequestTag(name.encode(), name.encode().ljust(16, b".")[:16])


def test_a_keyed_append_is_found_with_its_lsns_before_append_returns(open_wal: OpenWal) -> None:
    wal = open_wal(**WINDOW)
    wal.append_blocking(events(3))
    first, last = wal.append_blocking(events(5, tag="b"), tag("req-b"))
    entry = wal.find_request(b"req-b")
    assert entry is not None
    assert (entry.first_lsn, entry.last_lsn, entry.digest) == (first, last, tag("req-b").digest)
    assert (first, last) == (4, 8)
    assert wal.find_request(b"req-other") is None


def test_keys_of_one_group_get_the_lsns_of_their_own_append(open_wal: OpenWal) -> None:
    """Appends queued together share one frame; each key still names its own LSNs."""
    wal = open_wal(**WINDOW)

    async def burst() -> list[tuple[int, int]]:
        return await asyncio.gather(
            *(
                wal.append(events(i + 1, tag=f"g{i}"), tag(f"g{i}") if i % 2 else None)
                for i in range(8)
            )
        )

    results = asyncio.run(burst())
    for i, (first, last) in enumerate(results):
        entry = wal.find_request(f"g{i}".encode())
        if i % 2:
            assert entry is not None and (entry.first_lsn, entry.last_lsn) == (first, last)
        else:
            assert entry is None


def test_the_window_is_rebuilt_from_the_frames_on_open(open_wal: OpenWal, wal_dir: Path) -> None:
    wal = open_wal(segment_bytes=4096, **WINDOW)
    acked = {f"k{i}": wal.append_blocking(events(20, tag=f"k{i}"), tag(f"k{i}")) for i in range(30)}
    assert wal.segment_count() > 3
    wal.close()
    again = open_wal(segment_bytes=4096, **WINDOW)
    assert again.request_keys() == 30
    for key, (first, last) in acked.items():
        entry = again.find_request(key.encode())
        assert entry is not None and (entry.first_lsn, entry.last_lsn) == (first, last)


def test_keys_outlive_the_segments_retention_removes(open_wal: OpenWal, wal_dir: Path) -> None:
    wal = open_wal(segment_bytes=4096, **WINDOW)
    acked = {f"k{i}": wal.append_blocking(events(20, tag=f"k{i}"), tag(f"k{i}")) for i in range(30)}
    assert wal.truncate_below(wal.head_lsn()) > 0
    assert (wal_dir / SNAPSHOT).exists()
    wal.close()
    again = open_wal(segment_bytes=4096, **WINDOW)
    assert again.retained_floor() > acked["k10"][1], "the test needs keys of removed segments"
    for key, (first, last) in acked.items():
        entry = again.find_request(key.encode())
        assert entry is not None and (entry.first_lsn, entry.last_lsn) == (first, last), key


def test_a_key_torn_off_with_its_frame_is_not_in_the_window(
    open_wal: OpenWal, wal_dir: Path
) -> None:
    """A crash mid-write tears the last frame: its events and its key were never acked."""
    wal = open_wal(**WINDOW)
    wal.append_blocking(events(4, tag="kept"), tag("kept"))
    wal.append_blocking(events(4, tag="torn"), tag("torn"))
    wal.close()
    segment = next(wal_dir.glob("*.wal"))
    with segment.open("r+b") as f:
        f.truncate(segment.stat().st_size - 3)
    again = open_wal(**WINDOW)
    assert again.find_request(b"kept") is not None
    assert again.find_request(b"torn") is None
    assert again.head_lsn() == 4


def test_a_flipped_bit_in_a_request_table_is_caught_by_the_frame_crc(
    open_wal: OpenWal, wal_dir: Path
) -> None:
    wal = open_wal(**WINDOW)
    wal.append_blocking(events(2), tag("first"))
    wal.append_blocking(events(2, tag="x"), tag("second"))
    wal.close()
    segment = next(wal_dir.glob("*.wal"))
    data = bytearray(segment.read_bytes())
    flags = FRAME_HEADER.unpack_from(data, SEGMENT_HEADER_SIZE)[2]
    assert flags == FLAG_REQUESTS
    first_size = FRAME_HEADER.unpack_from(data, SEGMENT_HEADER_SIZE)[4]
    at = SEGMENT_HEADER_SIZE + first_size - 1  # the last byte of the first key
    data[at] ^= 0x01
    segment.write_bytes(bytes(data))
    result = scan(wal_dir, None)
    assert result.damage is not None and "CRC" in result.damage.reason
    assert not result.damage.torn, "an intact frame follows: this is damage, not a torn tail"


def test_wal_verify_checks_request_tables(open_wal: OpenWal, wal_dir: Path) -> None:
    wal = open_wal(**WINDOW)
    for i in range(5):
        wal.append_blocking(events(3, tag=f"v{i}"), tag(f"v{i}") if i % 2 else None)
    wal.close()
    out = io.StringIO()
    assert verify(wal_dir, out, progress=False) == 0, out.getvalue()
    frame = bytearray(next(wal_dir.glob("*.wal")).read_bytes())
    assert (
        sum(FRAME_HEADER.unpack_from(frame, SEGMENT_HEADER_SIZE)[2:3]) == 0
    )  # append 0 had no key


def test_the_window_forgets_the_oldest_keys_beyond_max_keys(open_wal: OpenWal) -> None:
    wal = open_wal(request_window_s=3600.0, request_max_keys=3)
    for i in range(5):
        wal.append_blocking(events(1, tag=f"c{i}"), tag(f"c{i}"))
    assert wal.request_keys() == 3
    assert [wal.find_request(f"c{i}".encode()) is not None for i in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]


def test_the_window_forgets_keys_older_than_window_s() -> None:
    window = RequestWindow(window_s=10.0, max_keys=100)
    window.add([RequestEntry(b"old", b"d" * 16, 1, 1, 1_000)], now_ms=1_000)
    window.add([RequestEntry(b"new", b"d" * 16, 2, 2, 9_000)], now_ms=9_000)
    assert window.get(b"old", now_ms=10_500) is not None
    assert window.get(b"old", now_ms=11_001) is None, "older than the window: not a replay"
    window.add([RequestEntry(b"newer", b"d" * 16, 3, 3, 12_000)], now_ms=12_000)
    assert len(window) == 2, "expired entries are evicted on the next add"
    assert window.get(b"new", now_ms=12_000) is not None


def test_a_zero_window_keeps_no_keys_but_the_frames_still_carry_them(
    open_wal: OpenWal, wal_dir: Path
) -> None:
    wal = open_wal()
    wal.append_blocking(events(2), tag("z"))
    assert wal.find_request(b"z") is None
    wal.close()
    assert open_wal(**WINDOW).find_request(b"z") is not None


def test_a_damaged_snapshot_is_reported_and_ignored(open_wal: OpenWal, wal_dir: Path) -> None:
    wal = open_wal(segment_bytes=4096, **WINDOW)
    for i in range(30):
        wal.append_blocking(events(20, tag=f"k{i}"), tag(f"k{i}"))
    wal.truncate_below(wal.head_lsn())
    last = wal.append_blocking(events(1, tag="late"), tag("late"))
    wal.close()
    snapshot = wal_dir / SNAPSHOT
    data = bytearray(snapshot.read_bytes())
    data[-1] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    with structlog.testing.capture_logs() as logs:
        again = open_wal(segment_bytes=4096, **WINDOW)
    assert any(e["event"] == "wal.requests_snapshot_damaged" for e in logs)
    entry = again.find_request(b"late")
    assert entry is not None and entry.first_lsn == last[0], "keys of retained frames stay"


@pytest.mark.parametrize(
    ("key", "digest"),
    [(b"", b"d" * 16), (b"k" * 70_000, b"d" * 16), (b"k", b"short")],
)
def test_an_invalid_request_tag_is_refused_before_anything_is_written(
    open_wal: OpenWal, key: bytes, digest: bytes
) -> None:
    wal = open_wal(**WINDOW)
    with pytest.raises(ValueError, match="request"):
        wal.append_blocking(events(1), RequestTag(key, digest))
    assert wal.head_lsn() == 0


def test_frames_without_keys_are_unchanged(open_wal: OpenWal, wal_dir: Path) -> None:
    """A frame without a request table keeps flags 0: logs written before keys existed, and
    appends that carry none, have the same bytes as before."""
    wal: Wal = open_wal(**WINDOW)
    wal.append_blocking(events(3))
    wal.close()
    data = next(wal_dir.glob("*.wal")).read_bytes()
    flags, _crc, size = FRAME_HEADER.unpack_from(data, SEGMENT_HEADER_SIZE)[2:5]
    assert flags == 0
    assert size == FRAME_HEADER.size + 3 * (20 + 8) + sum(len(p) for _c, p in events(3))
