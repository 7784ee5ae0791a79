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

A mirror with ``merge_interval_ms`` = N > 0 coalesces (docs/cdc.md,
"Coalesced merges"): its stage takes a batch and holds it (:class:`Coalesced`,
handed back :class:`~daemon.plane.batch.Held`: not done, so its progress, the
watermarks and the WAL keep it) until its first held batch is N ms old; then
the batch at hand, or the planner's ``flush_coalesced`` when none comes,
merges them all in one commit whose txn is the last one's id
(:meth:`MirrorTable.commit_many`). A crash loses only what was held, which
the restart re-runs from the plans; a clean stop merges it first.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog

from daemon.config import Config
from daemon.errors import ExecutorError, UnknownStreamError, error_text
from daemon.metrics import Metrics
from daemon.plane.batch import Held, InFlight, MicroBatch
from daemon.spark import frame
from daemon.spark.lanes import Lanes, hand_back, outlives
from daemon.table.crash import crash_point
from daemon.table.mirror import MirrorTable

log = structlog.get_logger("eventplane.mirror")


@dataclass(slots=True)
class Coalesced:
    """One mirror's batches held for their coalesced merge (``merge_interval_ms``)."""

    interval_s: float
    # The most events of the collection held (``merge_max_events``): the batch
    # that reaches it merges the group at once, whatever the interval says.
    max_events: int = 1_000_000
    since: float | None = None  # monotonic: when the first held batch was taken
    batches: list[MicroBatch] = field(default_factory=list)
    tables: list[Any] = field(default_factory=list)  # each one's rows of the collection
    events: int = 0

    def add(self, batch: MicroBatch, table: Any) -> None:
        if not self.batches:
            self.since = time.monotonic()
        self.batches.append(batch)
        self.tables.append(table)
        self.events += 0 if table is None else table.num_rows

    def due_in(self, now: float | None = None) -> float | None:
        """Seconds until the held batches are due to merge (<= 0: due); None: none held."""
        if not self.batches or self.since is None:
            return None
        if self.events >= self.max_events:
            return 0.0
        return self.since + self.interval_s - (time.monotonic() if now is None else now)

    def take(self) -> tuple[list[Any], list[MicroBatch]]:
        """The held batches and their rows, no longer held."""
        out = (self.tables, self.batches)
        self.clear()
        return out

    def clear(self) -> None:
        self.batches, self.tables, self.events, self.since = [], [], 0, None

    def status(self) -> dict[str, Any]:
        ids = [b.batch_id for b in self.batches]
        return {
            "merge_interval_ms": round(self.interval_s * 1000),
            "held_batches": len(ids),
            "held_batch_ids": [ids[0], ids[-1]] if ids else None,
            "held_events": self.events,
        }


def coalescers(mirrors: Sequence[MirrorTable]) -> dict[str, Coalesced]:
    """The held batches of each mirror that coalesces, by stage name."""
    return {
        mirror_stage(m): Coalesced(m.mirror.merge_interval_ms / 1000, m.mirror.merge_max_events)
        for m in mirrors
        if m.mirror.merge_interval_ms > 0
    }


def _collection_rows(table: Any, collection: str) -> Any:
    import pyarrow.compute as pc

    return table.filter(pc.equal(table["collection"], collection))


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
    coalesced: Mapping[str, Coalesced] | None = None,
    held: dict[str, Held] | None = None,
) -> int:
    """The batch, decoded once, merged by each wanted mirror that has rows in
    it (``counts``: the batch's rows per collection, when known), each in its
    own lane. A failure is its mirror's alone (``failures``); a merge that
    outlives ``wait_s`` goes on in its lane (``in_flight``), and
    ``landed_failure(error, stage)`` hears of it if it fails there. A mirror
    that coalesces (``coalesced``) holds the batch (``held``: ``Held``) until
    its first held batch is due, then merges them all. Returns how many
    mirror stages ran. Blocking."""
    rows: list[Any] = []
    ran = 0
    for mirror in mirrors:
        stage = mirror_stage(mirror)
        if stage not in wanted:
            continue
        ran += 1
        co = coalesced.get(stage) if coalesced else None
        empty = counts is not None and not counts.get(mirror.mirror.collection)
        if empty and (co is None or not co.batches):
            continue
        try:
            if not rows and not empty:
                rows.append(frame.batch_table(batch))
            if co is None:
                what = f"its merge of batch {batch.batch_id} into {mirror.mirror.location}"
                call = functools.partial(_merge, mirror, rows[0], batch, metrics)
            else:
                if co.batches and co.batches[-1].batch_id != batch.batch_id - 1:
                    co.clear()  # the stage went back to its progress: it re-runs them
                done = mirror.last_batch_id
                if not co.batches and done is not None and batch.batch_id <= done:
                    continue  # a re-run after a crash: the table holds it
                co.add(
                    batch, None if empty else _collection_rows(rows[0], mirror.mirror.collection)
                )
                crash_point("mirror.coalesced")
                due = co.due_in()
                if due is not None and due > 0:
                    # Never reported done: its progress waits for the merge.
                    assert held is not None, "a coalescing mirror needs its held batches"
                    held[stage] = Held(stage, batch.batch_id)
                    continue
                tables, batches = co.take()
                what = _coalesced_what(mirror, batches)
                call = functools.partial(_merge_many, mirror, tables, batches, metrics)
            running = lanes.submit(stage, what, call)
            if outlives(running, wait_s):
                landed = functools.partial(_landed, stage, landed_failure)
                in_flight[stage] = hand_back(stage, batch.batch_id, running, landed)
            else:
                running.result()
        except Exception as exc:
            failures[stage] = exc
            if co is not None:
                co.clear()  # the stage goes back to its progress and re-runs them
    return ran


def flush_mirrors(
    mirrors: Sequence[MirrorTable],
    coalesced: Mapping[str, Coalesced],
    *,
    force: bool,
    lanes: Lanes,
    wait_s: float,
    metrics: Metrics,
    landed_failure: Callable[[BaseException, str], None],
) -> dict[str, tuple[int, BaseException | None]]:
    """Each coalescing mirror's held batches that are due (all when ``force``)
    merged in one commit, in its lane; per stage, the last batch merged and
    the outcome: None (committed), the error, or ``InFlight`` (the merge
    outlived ``wait_s``). Blocking."""
    out: dict[str, tuple[int, BaseException | None]] = {}
    for mirror in mirrors:
        stage = mirror_stage(mirror)
        co = coalesced.get(stage)
        due = None if co is None else co.due_in()
        if co is None or due is None or (due > 0 and not force):
            continue
        tables, batches = co.take()
        bid = batches[-1].batch_id
        try:
            call = functools.partial(_merge_many, mirror, tables, batches, metrics)
            running = lanes.submit(stage, _coalesced_what(mirror, batches), call)
            if outlives(running, wait_s):
                landed = functools.partial(_landed, stage, landed_failure)
                out[stage] = (bid, hand_back(stage, bid, running, landed))
            else:
                running.result()
                out[stage] = (bid, None)
        except Exception as exc:
            out[stage] = (bid, exc)
    return out


def _coalesced_what(mirror: MirrorTable, batches: Sequence[MicroBatch]) -> str:
    first, last = batches[0].batch_id, batches[-1].batch_id
    return f"its coalesced merge of batches {first}..{last} into {mirror.mirror.location}"


def _merge_many(
    mirror: MirrorTable, tables: list[Any], batches: list[MicroBatch], metrics: Metrics
) -> None:
    """One mirror's coalesced commit of ``batches``, in its lane."""
    result = mirror.commit_many(tables, batches)
    for column, n in result.cast_failures.items():
        metrics.mirror_cast_failures.labels(mirror.name, column).inc(n)


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


def coalesce_due_s(coalesced: Mapping[str, Coalesced]) -> float | None:
    """Seconds until the first of ``coalesced``'s merges is due; None when none holds batches."""
    now = time.monotonic()
    waits = [w for co in coalesced.values() if (w := co.due_in(now)) is not None]
    return min(waits, default=None)


def flush_at_stop(
    mirrors: Sequence[MirrorTable],
    coalesced: Mapping[str, Coalesced],
    lanes: Lanes,
    cfg: Config,
    metrics: Metrics,
) -> None:
    """At stop, the batches still held merge (the planner's clean stop has
    merged them already; this covers a stop that came another way). Their
    progress is not recorded here: a restart finds them in the table (txn)."""
    if not any(co.batches for co in coalesced.values()):
        return
    out = flush_mirrors(
        mirrors,
        coalesced,
        force=True,
        lanes=lanes,
        wait_s=cfg.health.attempt_slow_s / 2,
        metrics=metrics,
        landed_failure=lambda exc, stage: None,
    )
    for stage, (bid, outcome) in out.items():
        log.info("mirror_coalesced_merged_at_stop", stage=stage, batch_id=bid, error=outcome)


def mirrors_status(
    mirrors: Sequence[MirrorTable], coalesced: Mapping[str, Coalesced]
) -> dict[str, Any]:
    """Each mirror's status, with the batches it holds for its coalesced merge."""
    out: dict[str, Any] = {}
    for m in mirrors:
        co = coalesced.get(mirror_stage(m))
        out[m.name] = {**m.status(), **(co.status() if co is not None else {})}
    return out


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
        self._coalesced: dict[str, Coalesced] = {}  # held batches, by stage

    def stage_names(self) -> list[str]:
        return [mirror_stage(m) for m in self._mirrors]

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._mirrors = await loop.run_in_executor(
            self._pool, open_mirrors, self.cfg, self.wal_id, self.metrics
        )
        self._coalesced = coalescers(self._mirrors)
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
    ) -> tuple[dict[str, BaseException], dict[str, BaseException], int]:
        failures: dict[str, BaseException] = {}
        in_flight: dict[str, InFlight] = {}
        held: dict[str, Held] = {}
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
            coalesced=self._coalesced,
            held=held,
        )
        return failures, {**in_flight, **held}, ran

    def coalesce_due_s(self) -> float | None:
        """Seconds until the first coalesced merge is due; None when no mirror holds batches."""
        return coalesce_due_s(self._coalesced)

    async def flush_coalesced(
        self, *, force: bool = False
    ) -> dict[str, tuple[int, BaseException | None]]:
        """Merge the held batches that are due (all of them when ``force``);
        per stage, the last batch merged and the outcome (None, the error, or
        ``InFlight``)."""
        if self._stopped or not self._ready:
            return {}
        loop = asyncio.get_running_loop()
        async with self._lock:
            out = await loop.run_in_executor(self._pool, self._flush, force)
        for stage, (_, outcome) in out.items():
            if outcome is not None and not isinstance(outcome, InFlight):
                self._failed(outcome, stage)
        return out

    def _flush(self, force: bool) -> dict[str, tuple[int, BaseException | None]]:
        return flush_mirrors(
            self._mirrors,
            self._coalesced,
            force=force,
            lanes=self._lanes,
            wait_s=self.cfg.health.attempt_slow_s / 2,
            metrics=self.metrics,
            landed_failure=self._failed,
        )

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
        flush_at_stop(self._mirrors, self._coalesced, self._lanes, self.cfg, self.metrics)
        close_mirrors(self._mirrors, self._lanes)
        self._lanes.close()

    def status(self) -> dict[str, Any]:
        return {
            "ready": self.ready(),
            "state": "stopped" if self._stopped else ("ready" if self._ready else "starting"),
            "spark": None,
            **self._last,
            "streams": {},
            "mirrors": mirrors_status(self._mirrors, self._coalesced),
        }
