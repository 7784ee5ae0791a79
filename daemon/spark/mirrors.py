"""The mirror stages (``mirror:<name>``, docs/cdc.md, "Mirror tables").

A mirror needs no Spark job: its stage decodes the batch's rows once
(``frame.batch_table``) and merges them with delta-rs
(:class:`daemon.table.mirror.MirrorTable`). The Spark executor runs the
mirror stages after the CDC streams (step 4b of :mod:`daemon.spark.executor`);
a daemon whose only work is mirrors runs them in :class:`MirrorExecutor`,
which starts no JVM. Either way each mirror merges (and compacts) in its own
lane (:mod:`daemon.spark.lanes`), waited for as a CDC stream's commit is: a
mirror whose store hangs holds back only itself (invariant 6). A strict
mirror's quarantine is replayed or purged in that lane too
(:class:`MirrorQuarantine`, both executors'), never beside a merge.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog

from daemon.config import Config
from daemon.errors import ExecutorError, UnknownStreamError, error_text
from daemon.metrics import Metrics
from daemon.plane.batch import InFlight, MicroBatch
from daemon.spark import frame
from daemon.spark.lanes import Lanes, hand_back, outlives
from daemon.table.crash import crash_point
from daemon.table.mirror import MirrorTable

log = structlog.get_logger("eventplane.mirror")


def mirror_stage(mirror: MirrorTable) -> str:
    """The stage name of a ``[[cdc.mirrors]]`` entry."""
    return f"mirror:{mirror.name}"


def open_mirrors(cfg: Config, wal_id: str, metrics: Metrics | None = None) -> list[MirrorTable]:
    """Each ``[[cdc.mirrors]]`` table, locked and checked (blocking); a
    quarantine that is not empty is logged (and its gauge set)."""
    mirrors: list[MirrorTable] = []
    try:
        for m in cfg.cdc.mirrors:
            mirror = MirrorTable(m, wal_id=wal_id, cores=cfg.daemon.cores)
            mirror.open()
            mirrors.append(mirror)
            if metrics is not None:
                metrics.mirror_quarantined_rows.labels(mirror.name).set(mirror.quarantined)
            if mirror.quarantined:
                log.warning(
                    "mirror_quarantine_not_empty",
                    mirror=mirror.name,
                    events=mirror.quarantined,
                    message=quarantine_notice(mirror.name, mirror.quarantined),
                )
    except BaseException:
        for mirror in mirrors:
            mirror.close()
        raise
    return mirrors


def quarantine_notice(name: str, held: int) -> str:
    """What health and the log say of a mirror's quarantine that is not empty."""
    return (
        f"mirror {name} holds {held} event(s) that did not fit its columns in its "
        f"quarantine: eventplane cdc mirror quarantine list {name}"
    )


def commit_mirrors(
    mirrors: Sequence[MirrorTable],
    batch: MicroBatch,
    wanted: Collection[str],
    counts: Mapping[str, int] | None,
    *,
    lanes: Lanes,
    wait_s: float,
    failures: dict[str, BaseException],
    in_flight: dict[str, InFlight],
    metrics: Metrics,
    landed_failure: Callable[[BaseException, str], None],
) -> int:
    """The batch, decoded once, merged by each wanted mirror that has rows in
    it (``counts``: the batch's rows per collection, when known), each in its
    own lane. A failure is its mirror's alone (``failures``); a merge that
    outlives ``wait_s`` goes on in its lane (``in_flight``), and
    ``landed_failure(error, stage)`` hears of it if it fails there. Returns
    how many mirror stages ran. Blocking."""
    rows: list[Any] = []
    ran = 0
    for mirror in mirrors:
        stage = mirror_stage(mirror)
        if stage not in wanted:
            continue
        ran += 1
        if counts is not None and not counts.get(mirror.mirror.collection):
            continue
        try:
            if not rows:
                rows.append(frame.batch_table(batch))
            what = f"its merge of batch {batch.batch_id} into {mirror.mirror.location}"
            call = functools.partial(_merge, mirror, rows[0], batch, metrics)
            running = lanes.submit(stage, what, call)
            if outlives(running, wait_s):
                landed = functools.partial(_landed, stage, landed_failure)
                in_flight[stage] = hand_back(stage, batch.batch_id, running, landed)
            else:
                running.result()
        except Exception as exc:
            failures[stage] = exc
    return ran


def _merge(mirror: MirrorTable, rows: Any, batch: MicroBatch, metrics: Metrics) -> None:
    """One mirror's commit of ``batch`` (its compaction included, when due), in its lane."""
    result = mirror.commit(rows, batch)
    for column, n in result.cast_failures.items():
        metrics.mirror_cast_failures.labels(mirror.name, column).inc(n)
    if mirror.mirror.strict:
        metrics.mirror_quarantined_rows.labels(mirror.name).set(mirror.quarantined)


def _landed(
    stage: str, landed_failure: Callable[[BaseException, str], None], running: Future[Any]
) -> None:
    exc = running.exception()
    if exc is not None:
        landed_failure(exc, stage)


def close_mirrors(mirrors: Sequence[MirrorTable], lanes: Lanes) -> None:
    """Close each mirror, but one whose merge still runs in its lane: closing
    would pull its lease and lock from under the merge; the lease expires by
    itself, and the next start re-runs the batch (its txn decides)."""
    for mirror in mirrors:
        stage = mirror_stage(mirror)
        if lanes.busy(stage):
            log.warning(
                "mirror_merge_in_flight_at_stop",
                mirror=mirror.name,
                waiting_for=lanes.waiting_for(stage),
            )
            continue
        mirror.close()


class MirrorQuarantine:
    """Quarantine actions on a strict mirror (``eventplane cdc mirror
    quarantine``, the admin API's ``/v1/cdc/mirror/<name>/quarantine/...``);
    part of both executors, whose ``__init__`` sets the state below."""

    metrics: Metrics
    _mirrors: list[MirrorTable]
    _lanes: Lanes

    async def mirror_quarantine_action(
        self, name: str, action: str, lsns: set[int] | None, by: str | None = None
    ) -> dict[str, Any]:
        """``replay`` or ``purge`` the quarantined events of mirror ``name``
        (all, or ``lsns``) in the mirror's lane, after the merges queued there."""
        mirror = next((m for m in self._mirrors if m.name == name), None)
        if mirror is None:
            raise UnknownStreamError(f"no mirror {name!r}")
        if action == "purge":
            what = f"a quarantine purge of {mirror.mirror.location}"
            call: Callable[[], Any] = functools.partial(mirror.purge_quarantine, lsns, by)
        elif action == "replay":
            what = f"a quarantine replay into {mirror.mirror.location}"
            call = functools.partial(mirror.replay_quarantine, lsns)
        else:
            raise ExecutorError(f"unknown quarantine action {action!r}")
        done = await asyncio.wrap_future(self._lanes.submit(mirror_stage(mirror), what, call))
        result: dict[str, Any] = {"mirror": name, "purged": done} if action == "purge" else done
        self.metrics.mirror_quarantined_rows.labels(name).set(mirror.quarantined)
        return {**result, "quarantined": mirror.quarantined}


class MirrorExecutor(MirrorQuarantine):
    """The executor of a daemon whose only stages are mirrors: no Spark.

    Implements ``daemon.plane.batch.Executor``; batches run one at a time in
    one worker thread, like the Spark executor's, and each mirror's merge in
    its own lane, waited for at most half of ``health.attempt_slow_s``."""

    def __init__(self, cfg: Config, metrics: Metrics, *, wal_id: str = "") -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.wal_id = wal_id
        self._mirrors: list[MirrorTable] = []
        self._lanes = Lanes()  # each mirror's own thread, by stage name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eventplane-mirror")
        self._lock = asyncio.Lock()
        self._ready = False
        self._stopped = False
        self._last: dict[str, Any] = {"last_batch_id": None, "last_error": None}

    def stage_names(self) -> list[str]:
        return [mirror_stage(m) for m in self._mirrors]

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._mirrors = await loop.run_in_executor(
            self._pool, open_mirrors, self.cfg, self.wal_id, self.metrics
        )
        # pyarrow's compute kernels load on the first decode (seconds on a busy
        # machine): loaded now, in the batches' thread, ahead of the first one.
        self._pool.submit(frame.batch_table, MicroBatch(0, {}))
        self._ready = True

    def ready(self) -> bool:
        return self._ready and not self._stopped

    def needs_restart(self) -> bool:
        return False

    async def execute(
        self,
        batch: MicroBatch,
        stages: Collection[str] | None = None,
        *,
        wait_s: float | None = None,
    ) -> dict[str, BaseException]:
        """Run ``batch`` for ``stages`` (all when None); the mirrors that failed,
        and as ``InFlight`` those whose merge outlived ``wait_s`` (default half
        of ``health.attempt_slow_s``) and goes on in its own lane."""
        if self._stopped:
            raise ExecutorError(f"batch {batch.batch_id}: the mirror executor is stopped")
        wanted = set(self.stage_names() if stages is None else stages)
        wait = self.cfg.health.attempt_slow_s / 2 if wait_s is None else max(wait_s, 0.0)
        loop = asyncio.get_running_loop()
        async with self._lock:
            failures, in_flight, ran = await loop.run_in_executor(
                self._pool, self._run, batch, wanted, wait
            )
        crash_point("executor.after_commit")
        now = time.time()
        if failures:
            name, exc = next(iter(failures.items()))
            self._failed(exc, name, now)
            if len(failures) == ran:
                raise exc
        self._last.update(last_batch_id=batch.batch_id, last_committed_at=now)
        return {**failures, **in_flight}

    def _run(
        self, batch: MicroBatch, wanted: set[str], wait_s: float
    ) -> tuple[dict[str, BaseException], dict[str, InFlight], int]:
        failures: dict[str, BaseException] = {}
        in_flight: dict[str, InFlight] = {}
        ran = commit_mirrors(
            self._mirrors,
            batch,
            wanted,
            None,
            lanes=self._lanes,
            wait_s=wait_s,
            failures=failures,
            in_flight=in_flight,
            metrics=self.metrics,
            landed_failure=self._failed,
        )
        return failures, in_flight, ran

    def _failed(self, exc: BaseException, stage: str, at: float | None = None) -> None:
        """Status's last error (a merge that failed in the batch or landed failed)."""
        when = time.time() if at is None else at
        self._last.update(last_error=f"stage {stage}: {error_text(exc)}", last_error_at=when)

    def waiting_for(self, stage: str) -> str | None:
        """What the running attempt of ``stage`` waits for (its merge), or None."""
        return self._lanes.waiting_for(stage)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        loop = asyncio.get_running_loop()
        async with self._lock:
            await loop.run_in_executor(self._pool, self._close)
        self._pool.shutdown(wait=False)

    def _close(self) -> None:
        close_mirrors(self._mirrors, self._lanes)
        self._lanes.close()

    def status(self) -> dict[str, Any]:
        return {
            "ready": self.ready(),
            "state": "stopped" if self._stopped else ("ready" if self._ready else "starting"),
            "spark": None,
            **self._last,
            "streams": {},
            "mirrors": {m.name: m.status() for m in self._mirrors},
        }
