"""Child process of the crash test: appends under concurrent load until it is SIGKILLed.

``python -m tests.wal.crash_writer DIR SEED`` opens the WAL in DIR, runs
concurrent producers and writes one line per acknowledged append to stdout:
``<first_lsn> <last_lsn> <tag>``, where event i of the append has payload
``payload(tag, i)`` and core ``core_of(tag, i)``. A line is written only after
``append`` returned, i.e. after the covering fdatasync.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import structlog

from wal import Wal

PRODUCERS = 6
SEGMENT_BYTES = 48 * 1024  # small, so kills also land in rotations


def payload(tag: str, i: int) -> bytes:
    return f'{{"tag":"{tag}","i":{i},"pad":"{"x" * (i % 37)}"}}'.encode()


def core_of(tag: str, i: int) -> int:
    return (len(tag) * 7 + i) % 4


async def produce(wal: Wal, seed: str, producer: int) -> None:
    rng = random.Random(f"{seed}:{producer}")
    k = 0
    while True:
        tag = f"{seed}.{producer}.{k}"
        n = rng.randint(1, 120)
        first, last = await wal.append([(core_of(tag, i), payload(tag, i)) for i in range(n)])
        sys.stdout.write(f"{first} {last} {tag}\n")
        sys.stdout.flush()
        k += 1


async def main(directory: Path, seed: str) -> None:
    wal = Wal.open(directory, segment_bytes=SEGMENT_BYTES)
    await asyncio.gather(*(produce(wal, seed, p) for p in range(PRODUCERS)))


if __name__ == "__main__":
    # stdout carries the acks; the WAL's log lines go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
