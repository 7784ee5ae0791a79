"""A slow stage holds back only itself, and health says so at once; an error
retrying cannot cure stops its stage (invariants 6 and 14)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from daemon.errors import ExecutorError, IdentityMismatchError, retry_cannot_cure
from daemon.plane.batch import InFlight, MicroBatch
from daemon.table.errors import CdcLayoutError, CdcLedgerMismatchError
from daemon.table.lease import LeaseError
from daemon.table.s3 import S3Error
from tests.core.conftest import StagedExecutor
from tests.core.test_stages import make, run_batches
from wal.record import Record


class HangingExecutor(StagedExecutor):
    """Stage ``cdc:b`` hangs on the batches in ``hang``: it is handed back
    ``InFlight``, and the test lands it (``land``)."""

    def __init__(self) -> None:
        super().__init__()
        self.hang: set[int] = set()
        self.pending: dict[int, Future[None]] = {}
        self.waits: list[float | None] = []

    async def execute(  # type: ignore[override]
        self, batch: MicroBatch, stages: Any = None, *, wait_s: float | None = None
    ) -> dict[str, BaseException]:
        self.waits.append(wait_s)
        wanted = tuple(self.names if stages is None else stages)
        rest = tuple(n for n in wanted if n != "cdc:b" or batch.batch_id not in self.hang)
        failures = await super().execute(batch, rest)
        if "cdc:b" in wanted and batch.batch_id in self.hang:
            done: Future[None] = Future()
            self.pending[batch.batch_id] = done
            failures["cdc:b"] = InFlight("cdc:b", batch.batch_id, done)
        return failures

    def waiting_for(self, stage: str) -> str | None:
        return f"its commit of batch {min(self.pending)} to s3://b" if self.pending else None

    def land(self, batch_id: int, exc: BaseException | None = None) -> None:
        done = self.pending.pop(batch_id)
        if exc is None:
            self.runs["cdc:b"].append(batch_id)
            done.set_result(None)
        else:
            done.set_exception(exc)


async def test_a_hung_stage_is_slow_at_once_and_the_other_stage_commits_the_next_batches(
    tmp_path: Path,
) -> None:
    """1. cdc:b's attempt at batch 2 hangs: it comes back in flight; 2. cdc:a
    commits batches 2-5 meanwhile, and b takes none; 3. b is slow once its
    attempt passes attempt_slow_s, naming what it waits for; 4. it lands,
    catches up 3-5 from the plans and the watermarks reach batch 5."""
    now = [100.0]
    executor = HangingExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal, clock=lambda: now[0], attempt_slow_s=2.0)
    await run_batches(planner, wal, range(1, 2))
    executor.hang.add(2)

    await run_batches(planner, wal, range(2, 3))  # Step 1.
    await run_batches(planner, wal, range(3, 6))  # Step 2.

    assert executor.runs == {"cdc:a": [1, 2, 3, 4, 5], "cdc:b": [1]}
    assert [c for c in executor.calls if c[0] > 2 and "cdc:b" in c[1]] == []
    entry = planner.stages.entry("cdc:b", planner.live_id)
    assert entry["in_flight"] and not entry["slow"] and not entry["failing"]
    now[0] += 2.5  # Step 3.
    entry = planner.stages.entry("cdc:b", planner.live_id)
    assert entry["slow"] and entry["attempt_batch_id"] == 2 and entry["attempt_for_s"] == 2.5
    assert entry["waiting_for"] == "its commit of batch 2 to s3://b"
    sample = planner.metrics.registry.get_sample_value
    assert sample("eventplane_stage_slow", {"stage": "cdc:b"}) == 1.0
    assert sample("eventplane_stage_attempt_seconds", {"stage": "cdc:b"}) == 2.5
    assert sample("eventplane_stage_slow", {"stage": "cdc:a"}) == 0.0
    assert planner.watermarks.batch_id == 1  # the WAL keeps what b needs

    executor.land(2)  # Step 4.
    await asyncio.sleep(0)  # the landing is called on the loop
    assert planner.watermarks.batch_id == 2
    assert not planner.stages.slow("cdc:b")
    await planner._run_behind()
    assert executor.runs["cdc:b"] == [1, 2, 3, 4, 5]
    assert planner.watermarks.batch_id == 5
    # Not failing, b catching up is waited for as long as a live batch.
    assert executor.waits[-3:] == [None, None, None]


async def test_a_hung_attempt_that_fails_when_it_lands_is_retried_with_backoff(
    tmp_path: Path,
) -> None:
    now = [100.0]
    executor = HangingExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal, clock=lambda: now[0])
    executor.hang.add(1)
    await run_batches(planner, wal, range(1, 3))

    executor.land(1, S3Error("s3: read timeout"))
    executor.hang.clear()
    await asyncio.sleep(0)

    entry = planner.stages.entry("cdc:b", planner.live_id)
    assert entry["failing"] and not entry["stopped"] and not entry["in_flight"]
    assert entry["next_retry_in_s"] is not None
    assert planner.stages.slow("cdc:b") is False
    now[0] += 6.0  # slow: batch 1 not committed 6 s after its first attempt
    assert planner.stages.slow("cdc:b")
    assert "after S3Error: s3: read timeout" in planner.stages.waiting_for("cdc:b")
    await planner._run_behind()
    assert executor.runs["cdc:b"] == [1, 2]
    assert executor.waits[-2] == 0.0  # a failing stage's retry is not waited for
    assert not planner.stages.slow("cdc:b")


@pytest.mark.parametrize(
    "error",
    [
        CdcLedgerMismatchError("batch 2 is in the ledger with other LSN ranges"),
        CdcLayoutError("partition_by changed"),
        IdentityMismatchError("another WAL"),
        ExecutorError("wrapped"),  # raised from a ledger mismatch, below
    ],
    ids=lambda e: type(e).__name__,
)
async def test_an_error_retrying_cannot_cure_stops_the_stage_until_resumed(
    tmp_path: Path, error: Exception
) -> None:
    """1. b fails batch 2 with an error whose class says retriable = False;
    2. it is not retried however long it waits, a is not held back; 3. health
    names the class; 4. resume retries it and it catches up."""
    if isinstance(error, ExecutorError):
        error.__cause__ = CdcLedgerMismatchError("inner")
    now = [100.0]
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal, clock=lambda: now[0])
    await run_batches(planner, wal, range(1, 2))
    real = executor.execute
    fixed = [False]

    async def failing_b(batch: MicroBatch, stages: Any = None) -> dict[str, BaseException]:
        got = await real(batch, tuple(s for s in stages if s != "cdc:b"))
        if "cdc:b" in stages and batch.batch_id == 2 and not fixed[0]:
            got["cdc:b"] = error
        elif "cdc:b" in stages:
            executor.runs["cdc:b"].append(batch.batch_id)
        return got

    executor.execute = failing_b  # type: ignore[method-assign]
    await run_batches(planner, wal, range(2, 4))  # Step 1.
    now[0] += 3600.0  # Step 2.
    await planner._run_behind()
    await run_batches(planner, wal, range(4, 5))

    assert executor.runs["cdc:a"] == [1, 2, 3, 4] and executor.runs["cdc:b"] == [1]
    entry = planner.stages.entry("cdc:b", planner.live_id)
    cause = retry_cannot_cure(error)
    assert cause is not None
    assert entry["stopped"] and entry["stopped_by"] == type(cause).__name__  # Step 3.
    assert entry["next_retry_in_s"] is None
    fixed[0] = True
    assert planner.resume_stage("cdc:b") is True  # Step 4.
    await planner._run_behind()
    assert executor.runs["cdc:b"] == [1, 2, 3, 4]
    assert not planner.stages.stopped("cdc:b")


@pytest.mark.parametrize(
    "error",
    [
        S3Error("s3: connection refused"),
        OSError(28, "No space left on device"),
        LeaseError("cannot renew the lease"),
        ExecutorError("py4j.protocol.Py4JJavaError: An error occurred"),
        RuntimeError("a handler raised"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_transient_errors_are_retried(error: Exception) -> None:
    assert retry_cannot_cure(error) is None
