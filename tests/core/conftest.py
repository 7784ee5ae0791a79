"""Factories for the event-plane core tests: configs, records, a recording executor."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable
from dataclasses import replace
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest

from daemon.config import (
    Config,
    ConsumerConfig,
    DaemonConfig,
    MicrobatchConfig,
    WalConfig,
)
from daemon.errors import ExecutorError
from daemon.plane.batch import MicroBatch
from daemon.service.metrics import Metrics
from wal.reader import RecordBatch
from wal.record import Record


class RecordingExecutor:
    """Test double for :class:`daemon.plane.batch.Executor`: records every batch.

    ``fail_next`` makes the next N attempts raise; ``stall`` (an Event) makes
    attempts wait until it is set; ``is_ready`` drives ``ready()``.
    """

    def __init__(self) -> None:
        self.committed: list[MicroBatch] = []
        self.attempts: list[MicroBatch] = []
        self.fail_next = 0
        self.stall: asyncio.Event | None = None
        self.is_ready = True
        self.rows_seen = 0
        self.changed = asyncio.Event()

    async def start(self) -> None:
        return None

    def ready(self) -> bool:
        return self.is_ready

    async def execute(self, batch: MicroBatch) -> None:
        self.attempts.append(batch)
        if self.stall is not None:
            await self.stall.wait()
        if self.fail_next:
            self.fail_next -= 1
            raise ExecutorError(f"injected failure of batch {batch.batch_id}")
        self.committed.append(batch)
        self.rows_seen += batch.rows
        self.changed.set()

    async def stop(self) -> None:
        return None

    def per_core(self) -> dict[int, list[Record]]:
        out: dict[int, list[Record]] = {}
        for batch in self.committed:
            for core, s in sorted(batch.slices.items()):
                out.setdefault(core, []).extend(s.records)
        return out

    async def wait_rows(self, rows: int, within_s: float = 30.0) -> None:
        async with asyncio.timeout(within_s):
            while self.rows_seen < rows:
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
def executor() -> RecordingExecutor:
    return RecordingExecutor()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


MakeConfig = Callable[..., Config]


@pytest.fixture
def make_config(tmp_path: Path) -> MakeConfig:
    """Config factory: small, fast defaults; override any section's fields by keyword.

    ``make_config(cores=2, ring_capacity=4, interval_ms=10)`` -- each keyword is
    looked up in daemon, consumer, microbatch and wal, in that order.
    """

    def make(data_dir: Path | None = None, **overrides: Any) -> Config:
        sections: dict[str, Any] = {
            "daemon": DaemonConfig(data_dir=data_dir or tmp_path / "data", cores=4),
            "consumer": ConsumerConfig(
                poll_min_ms=0.2, poll_max_ms=2.0, replay_retry_ms=1, watermark_flush_ms=20
            ),
            "microbatch": MicrobatchConfig(interval_ms=10, retry_initial_ms=1, retry_max_ms=8),
            "wal": WalConfig(segment_bytes=1024 * 1024),
        }
        for key, value in overrides.items():
            for name, section in sections.items():
                if key in section.__dataclass_fields__:
                    sections[name] = replace(section, **{key: value})
                    break
            else:
                raise TypeError(f"no config field {key!r}")
        return Config(**sections)

    return make


def rec(lsn: int, core: int = 0, seq: int | None = None, payload: bytes = b"x") -> Record:
    return Record(lsn, core, lsn if seq is None else seq, payload)


def columnar(lsns: list[int], core: int = 0, payload: bytes = b"x") -> RecordBatch:
    """A WAL-style columnar batch of ``lsns`` (sequence = LSN), same payload each."""
    offsets = array("Q", accumulate([len(payload)] * len(lsns), initial=0))
    return RecordBatch(core, array("Q", lsns), lsns[0] if lsns else 1, offsets, payload * len(lsns))


class StagedExecutor(RecordingExecutor):
    """A recording executor with named stages (``daemon.plane.stages``).

    ``failing`` holds the stages that fail every batch they are given, until
    removed; ``runs[stage]`` lists the batch ids each stage committed, in order.
    """

    def __init__(self, names: tuple[str, ...] = ("cdc:a", "cdc:b")) -> None:
        super().__init__()
        self.names = names
        self.failing: set[str] = set()
        self.runs: dict[str, list[int]] = {n: [] for n in names}
        self.calls: list[tuple[int, tuple[str, ...]]] = []

    def stage_names(self) -> tuple[str, ...]:
        return self.names

    async def execute(  # type: ignore[override]
        self, batch: MicroBatch, stages: Any = None
    ) -> dict[str, BaseException]:
        wanted = tuple(self.names if stages is None else stages)
        self.calls.append((batch.batch_id, wanted))
        self.attempts.append(batch)
        if self.fail_next:
            self.fail_next -= 1
            raise ExecutorError(f"injected failure of batch {batch.batch_id}")
        failures: dict[str, BaseException] = {}
        for name in wanted:
            if name in self.failing:
                failures[name] = ExecutorError(f"{name} cannot write batch {batch.batch_id}")
            else:
                self.runs[name].append(batch.batch_id)
        self.committed.append(batch)
        self.rows_seen += batch.rows
        self.changed.set()
        return failures

    async def wait_run(self, stage: str, batch_id: int, within_s: float = 5.0) -> None:
        """Until ``stage`` has committed ``batch_id``."""
        async with asyncio.timeout(within_s):
            while batch_id not in self.runs[stage]:
                self.changed.clear()
                await self.changed.wait()
