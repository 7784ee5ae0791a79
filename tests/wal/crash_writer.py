"""Child process of the crash test: appends under concurrent load until it is SIGKILLed.

``python -m tests.wal.crash_writer DIR SEED [keys]`` opens the WAL in DIR, runs
concurrent producers and writes ``ready`` once its imports are done, then one
line per acknowledged append to stdout:
``<first_lsn> <last_lsn> <tag>``, where event i of the append has payload
``payload(tag, i)`` and core ``core_of(tag, i)``. A line is written only after
``append`` returned, i.e. after the covering fdatasync.

With ``keys``, every append carries the request key ``tag`` (digest
``digest(tag)``) and retention removes all but the last few segments as the
log grows, so kills also land around the window's snapshot.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import structlog

from wal import Wal
from wal.format import RequestTag

PRODUCERS = 6
SEGMENT_BYTES = 48 * 1024  # small, so kills also land in rotations


def payload(tag: str, i: int) -> bytes:
    return f'{{"tag":"{tag}","i":{i},"pad":"{"x" * (i % 37)}"}}'.encode()


def core_of(tag: str, i: int) -> int:
    return (len(tag) * 7 + i) % 4


def digest(tag: str) -> bytes:
    return tag.encode().ljust(16, b"-")[-16:]


def open_keyed(directory: Path) -> Wal:
    return Wal.open(
        directory, segment_bytes=SEGMENT_BYTES, request_window_s=3600, request_max_keys=10**6
    )


async def produce(wal: Wal, seed: str, producer: int, keys: bool) -> None:
    rng = random.Random(f"{seed}:{producer}")
    k = 0
    while True:
        tag = f"{seed}.{producer}.{k}"
        n = rng.randint(1, 120)
        request = RequestTag(tag.encode(), digest(tag)) if keys else None
        items = [(core_of(tag, i), payload(tag, i)) for i in range(n)]
        first, last = await wal.append(items, request)
        sys.stdout.write(f"{first} {last} {tag}\n")
        sys.stdout.flush()
        k += 1
        if keys and k % 8 == 0 and wal.segment_count() > 3:
            await asyncio.to_thread(wal.truncate_below, wal.head_lsn() - 2000)


async def main(directory: Path, seed: str, keys: bool) -> None:
    # Imports done: the parent's kill clock starts here, not at the spawn (an
    # interpreter start on a loaded machine can outlast the whole delay). The
    # WAL's open, its recovery included, is still within the delay.
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    wal = open_keyed(directory) if keys else Wal.open(directory, segment_bytes=SEGMENT_BYTES)
    await asyncio.gather(*(produce(wal, seed, p, keys) for p in range(PRODUCERS)))


if __name__ == "__main__":
    # stdout carries the acks; the WAL's log lines go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:] == ["keys"]))
