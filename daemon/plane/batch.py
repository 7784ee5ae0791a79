"""Micro-batch types and the seams between the planner and what runs a batch.

One micro-batch = one slice (inclusive LSN range) per core. The plan
``batch_id -> slices`` is durable before the batch runs, so a re-run after a
crash has the same id and the same rows (Spark's offset-log rule).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from daemon.errors import DaemonError
from wal.record import Record


@dataclass(frozen=True, slots=True)
class Slice:
    core: int
    first_lsn: int  # inclusive
    last_lsn: int  # inclusive
    records: Sequence[Record]  # this core's events in the range, LSN order

    @property
    def rows(self) -> int:
        return len(self.records)


@dataclass(frozen=True, slots=True)
class MicroBatch:
    batch_id: int  # starts at 1, +1 per planned batch, never reused
    slices: Mapping[int, Slice]  # core -> slice; cores with nothing are absent

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.slices.values())

    def ranges(self) -> dict[int, tuple[int, int]]:
        return {c: (s.first_lsn, s.last_lsn) for c, s in self.slices.items()}


class Executor(Protocol):
    """Runs a planned micro-batch for some of its stages.

    Called on the event loop; implementations move blocking work (py4j) to a
    worker thread. ``execute(batch, stages)`` runs the named stages (all of
    them when ``stages`` is None) and returns the stages that failed, each
    with its error: every stage not in that mapping has committed its effects
    (invariant 6). Raising means nothing of the batch can be trusted to have
    committed; the planner retries it with backoff and the same id and rows.
    ``ready`` tells the planner when batches can be handed over (Spark starts
    in the background). An executor may name its stages (``stage_names()``,
    see ``daemon.plane.stages``); one that does not is a single stage.

    A stage whose attempt has not finished when the executor stops waiting
    for it (half of ``health.attempt_slow_s``, at once for a failing stage)
    is returned as :class:`InFlight`: it is neither done nor failed,
    and its outcome comes later on ``InFlight.done`` (invariant 6: the
    other stages do not wait for it).
    """

    async def start(self) -> None: ...

    def ready(self) -> bool: ...

    async def execute(
        self, batch: MicroBatch, stages: Collection[str] | None = None
    ) -> Mapping[str, BaseException] | None: ...

    async def stop(self) -> None: ...


class InFlight(DaemonError):
    """A stage's attempt at ``batch_id`` is still running in its own thread.

    ``done`` resolves (in that thread) to None once the stage committed the
    batch, or to the stage's error. Until then the stage takes no other batch.
    """

    def __init__(self, stage: str, batch_id: int, done: Future[None]) -> None:
        self.stage = stage
        self.batch_id = batch_id
        self.done = done
        super().__init__(f"stage {stage}: its attempt at batch {batch_id} is still running")


class Held(DaemonError):
    """A stage took ``batch_id`` but holds it for a later commit with the
    batches after it (a mirror's ``merge_interval_ms``, docs/cdc.md, "Coalesced
    merges"): it is not done, so its progress stays (and with it the
    watermarks and the WAL), yet the stage takes the next batch. Its commit
    comes as the outcome of a later batch, or of the executor's
    ``flush_coalesced`` (the planner calls it when a wait is over and at a
    clean stop); a failure there sends the stage back to its progress."""

    def __init__(self, stage: str, batch_id: int) -> None:
        self.stage = stage
        self.batch_id = batch_id
        super().__init__(f"stage {stage}: batch {batch_id} waits for its coalesced merge")


@runtime_checkable
class Preparer(Protocol):
    """An executor that can start on a batch's input while the previous batch runs.

    ``prepare(batch)`` is a hint, called on the event loop for a batch that is
    planned and will be the next one executed; it must not block and must not
    commit anything. ``execute(batch)`` stays correct whether or not the
    preparation finished or succeeded.

    Optional: ``prepare_seconds(rows) -> float``, how long preparing that many
    rows is expected to take. The planner closes the next batch that much
    before the running one should commit (docs/consumers.md, "Closing ahead");
    without it, 0 is assumed.
    """

    def prepare(self, batch: MicroBatch) -> None: ...


class BatchStage(Protocol):
    """One consumer of each batch's DataFrame inside the Spark executor.

    ``run_in_spark`` runs in the Spark worker thread with the batch DataFrame
    (the CDC schema of the README); its result is passed to ``finish`` on the event
    loop, which returns only when the stage's effects are complete or durably
    queued (invariant 6). Triggers plug in here. A stage that caches the
    session, or objects made from it, also implements ``SessionAware``.
    """

    name: str

    def run_in_spark(self, spark: Any, df: Any, batch: MicroBatch) -> Any: ...

    async def finish(self, batch: MicroBatch, result: Any) -> None: ...


@runtime_checkable
class SessionAware(Protocol):
    """A BatchStage that keeps things tied to one SparkSession (the optional hook).

    The executor calls ``on_session(spark)`` in its worker thread, with no
    batch running, after every session it builds or is given: at start, and
    after rebuilding a lost one (the driver JVM died). Anything made from the
    previous session (Columns, analysed plans, the session itself) must be
    dropped then: its JVM objects are gone.
    """

    def on_session(self, spark: Any) -> None: ...


class NullExecutor:
    """The executor when no CDC stream, handler or trigger is configured.

    A batch has nothing to do, so it commits at once; watermarks and WAL
    retention keep moving without starting Spark.
    """

    async def start(self) -> None:
        return None

    def ready(self) -> bool:
        return True

    async def execute(
        self, batch: MicroBatch, stages: Collection[str] | None = None
    ) -> Mapping[str, BaseException] | None:
        return None

    async def stop(self) -> None:
        return None
