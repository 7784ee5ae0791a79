"""The unit the WAL hands back to readers and listeners."""

from __future__ import annotations

from typing import NamedTuple


class Record(NamedTuple):
    """One durable event. ``payload`` is opaque to the WAL."""

    lsn: int  # global, strictly increasing, never reused; first LSN of a new WAL is 1
    core: int  # shard the event belongs to
    seq: int  # per-core sequence; restarts at 1 with each process (dedupe uses LSN)
    payload: bytes
