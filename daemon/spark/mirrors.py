"""The mirror stages (``mirror:<name>``, docs/cdc.md, "Mirror tables").

A mirror needs no Spark job: its stage decodes the batch's rows once
(``frame.batch_table``) and merges them with delta-rs
(:class:`daemon.table.mirror.MirrorTable`). The Spark executor runs the
mirror stages after the CDC streams (step 4b of :mod:`daemon.spark.executor`);
a daemon whose only work is mirrors runs them in :class:`MirrorExecutor`,
which starts no JVM.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from daemon.config import Config
from daemon.errors import ExecutorError, error_text
from daemon.metrics import Metrics
from daemon.plane.batch import MicroBatch
from daemon.spark import frame
from daemon.table.crash import crash_point
from daemon.table.mirror import MirrorTable

log = structlog.get_logger("eventplane.mirror")


def mirror_stage(mirror: MirrorTable) -> str:
    """The stage name of a ``[[cdc.mirrors]]`` entry."""
    return f"mirror:{mirror.name}"


def open_mirrors(cfg: Config, wal_id: str) -> list[MirrorTable]:
    """Each ``[[cdc.mirrors]]`` table, locked and checked (blocking)."""
    mirrors: list[MirrorTable] = []
    try:
        for m in cfg.cdc.mirrors:
            mirror = MirrorTable(m, wal_id=wal_id, cores=cfg.daemon.cores)
            mirror.open()
            mirrors.append(mirror)
    except BaseException:
        for mirror in mirrors:
            mirror.close()
        raise
    return mirrors


def commit_mirrors(
    mirrors: list[MirrorTable],
    batch: MicroBatch,
    wanted: Collection[str],
    counts: Mapping[str, int] | None,
    failures: dict[str, BaseException],
    metrics: Metrics,
) -> int:
    """The batch, decoded once, merged by each wanted mirror that has rows in
    it (``counts``: the batch's rows per collection, when known); a failure
    is its mirror's alone. Returns how many mirror stages ran. Blocking."""
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
            result = mirror.commit(rows[0], batch)
        except Exception as exc:
            failures[stage] = exc
            continue
        for column, n in result.cast_failures.items():
            metrics.mirror_cast_failures.labels(mirror.name, column).inc(n)
    return ran


class MirrorExecutor:
    """The executor of a daemon whose only stages are mirrors: no Spark.

    Implements ``daemon.plane.batch.Executor``; batches run one at a time in
    one worker thread, like the Spark executor's."""

    def __init__(self, cfg: Config, metrics: Metrics, *, wal_id: str = "") -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.wal_id = wal_id
        self._mirrors: list[MirrorTable] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eventplane-mirror")
        self._lock = asyncio.Lock()
        self._ready = False
        self._stopped = False
        self._last: dict[str, Any] = {"last_batch_id": None, "last_error": None}

    def stage_names(self) -> list[str]:
        return [mirror_stage(m) for m in self._mirrors]

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._mirrors = await loop.run_in_executor(self._pool, open_mirrors, self.cfg, self.wal_id)
        # pyarrow's compute kernels load on the first decode (seconds on a busy
        # machine): loaded now, in the batches' thread, ahead of the first one.
        self._pool.submit(frame.batch_table, MicroBatch(0, {}))
        self._ready = True

    def ready(self) -> bool:
        return self._ready and not self._stopped

    def needs_restart(self) -> bool:
        return False

    async def execute(
        self, batch: MicroBatch, stages: Collection[str] | None = None
    ) -> dict[str, BaseException]:
        if self._stopped:
            raise ExecutorError(f"batch {batch.batch_id}: the mirror executor is stopped")
        wanted = set(self.stage_names() if stages is None else stages)
        loop = asyncio.get_running_loop()
        async with self._lock:
            failures, ran = await loop.run_in_executor(self._pool, self._run, batch, wanted)
        crash_point("executor.after_commit")
        now = time.time()
        if failures:
            name, exc = next(iter(failures.items()))
            self._last.update(last_error=f"stage {name}: {error_text(exc)}", last_error_at=now)
            if len(failures) == ran:
                raise exc
        self._last.update(last_batch_id=batch.batch_id, last_committed_at=now)
        return failures

    def _run(self, batch: MicroBatch, wanted: set[str]) -> tuple[dict[str, BaseException], int]:
        failures: dict[str, BaseException] = {}
        ran = commit_mirrors(self._mirrors, batch, wanted, None, failures, self.metrics)
        return failures, ran

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        loop = asyncio.get_running_loop()
        async with self._lock:
            await loop.run_in_executor(self._pool, self._close)
        self._pool.shutdown(wait=False)

    def _close(self) -> None:
        for mirror in self._mirrors:
            mirror.close()

    def status(self) -> dict[str, Any]:
        return {
            "ready": self.ready(),
            "state": "stopped" if self._stopped else ("ready" if self._ready else "starting"),
            "spark": None,
            **self._last,
            "streams": {},
            "mirrors": {m.name: m.status() for m in self._mirrors},
        }
