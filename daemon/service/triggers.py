"""Plugs the trigger engine into the daemon.

``triggers/`` does not import the daemon, so the daemon hands it what it
needs: the data dir, the metrics, and an ``emit`` that turns derived events
into WAL appends (the same path as producer events: durable before they are
dispatched, sharded by (collection, key)). This module takes those as
parameters and does not import :mod:`daemon.service.app`, which calls it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from daemon import events as ev
from daemon.shard import core_of
from triggers.engine import TriggerEngine

if TYPE_CHECKING:
    from daemon.config import Config
    from daemon.service.metrics import Metrics
    from triggers.spec import Trigger, TriggerSpecLike
    from wal import Wal

log = structlog.get_logger("eventplane.triggers")


def _json_or_none(value: Any) -> bytes | None:
    return None if value is None else msgspec.json.encode(value)


def build_trigger_stage(
    cfg: Config,
    wal_of: Callable[[], Wal | None],
    metrics: Metrics,
    specs: Sequence[TriggerSpecLike] | None = None,
) -> TriggerEngine:
    """The ``"triggers"`` batch stage; ``wal_of()`` is the open WAL, or None before it opens.

    ``specs``: the trigger set (default ``cfg.triggers``; a reload passes the new one).
    """

    async def emit(derived: list[dict[str, Any]]) -> None:
        wal = wal_of()
        if wal is None:  # emit runs inside batches, which start after the WAL opened
            raise RuntimeError("emit before the WAL opened")
        now = time.time_ns()
        items = []
        for d in derived:
            stored = ev.StoredEvent(
                collection=d["collection"],
                op=d["op"],
                key=str(d["key"]),
                new=_json_or_none(d.get("new")),
                old=_json_or_none(d.get("old")),
                ingest_ts_ns=now,
                depth=int(d.get("depth", 1)),
                source=str(d.get("source", "")),
            )
            items.append(
                (core_of(stored.collection, stored.key, cfg.daemon.cores), ev.encode(stored))
            )
        if items:
            await wal.append(items)

    return TriggerEngine(
        cfg.triggers if specs is None else specs,
        data_dir=cfg.data_dir,
        emit=emit,
        metrics=metrics,
        dlq_max_entries=cfg.dlq.max_entries,
    )


async def validate_when_spark_ready(
    executor: Any, engine: TriggerEngine, fail: Callable[[str], None]
) -> None:
    """Startup check: Spark analyses every ``when``; errors go to ``fail`` (stop the daemon).

    ``executor`` is the Spark executor (triggers always run on Spark): Spark
    starts in the background, so this runs as soon as it is ready; no batch
    reaches the engine before the executor is ready either.
    """
    await executor.wait_ready()
    errors = await asyncio.to_thread(engine.validate, executor.session)
    if errors:
        for message in errors:
            log.error("trigger_invalid", error=message)
        fail(f"{len(errors)} invalid trigger(s): " + "; ".join(errors))
    else:
        log.info("triggers_validated", triggers=sorted(engine.triggers))


def trigger_changes(
    before: Mapping[str, Trigger], after: Mapping[str, Trigger]
) -> dict[str, list[str]]:
    """What a reload did to the trigger set, by name: added, removed, changed, unchanged.

    A trigger that only moved in ``[[triggers]]`` is unchanged (its position
    names it in error messages, nothing else).
    """

    def same(a: Trigger, b: Trigger) -> bool:
        return dataclasses.replace(a, index=0) == dataclasses.replace(b, index=0)

    both = sorted(before.keys() & after.keys())
    return {
        "added": sorted(after.keys() - before.keys()),
        "removed": sorted(before.keys() - after.keys()),
        "changed": [n for n in both if not same(before[n], after[n])],
        "unchanged": [n for n in both if same(before[n], after[n])],
    }


TRIGGER_PREFIX = "trigger:"


class StagePauses:
    """The admin API's pause and resume: ``trigger:<name>`` pauses one trigger
    (the engine queues its calls), every other name a stage of the event plane
    (``cdc:<stream>``, ``triggers``, ``handler:<ref>``)."""

    def __init__(self, plane: Any, engine: Callable[[], TriggerEngine | None]) -> None:
        self._plane = plane
        self._engine = engine

    async def pause_stage(
        self, name: str, *, reason: str | None = None, by: str | None = None
    ) -> dict[str, Any]:
        if not name.startswith(TRIGGER_PREFIX):
            with self._naming_every_pausable():
                answer: dict[str, Any] = await self._plane.pause_stage(name, reason=reason, by=by)
            return answer
        engine, trigger = self._trigger(name)
        changed = await engine.pause_trigger(trigger, reason=reason or "", by=by or "")
        return {"changed": changed, "stage": engine.pause_entry(trigger)}

    async def resume_stage(self, name: str) -> dict[str, Any]:
        if not name.startswith(TRIGGER_PREFIX):
            with self._naming_every_pausable():
                answer: dict[str, Any] = await self._plane.resume_stage(name)
            return answer
        engine, trigger = self._trigger(name)
        changed = await engine.resume_trigger(trigger)
        return {"changed": changed, "stage": engine.pause_entry(trigger)}

    def _trigger(self, name: str) -> tuple[TriggerEngine, str]:
        from daemon.plane.stages import UnknownStageError

        engine = self._engine()
        trigger = name[len(TRIGGER_PREFIX) :]
        if engine is None or (trigger not in engine.triggers and not engine.is_paused(trigger)):
            raise UnknownStageError(name, self._pausable([]))
        return engine, trigger

    def _pausable(self, stages: Sequence[str]) -> list[str]:
        """Every name pause and resume take: the plane's stages, then each trigger."""
        engine = self._engine()
        planner = getattr(self._plane, "planner", None)
        if not stages and planner is not None:
            stages = planner.stages.names
        triggers = sorted(engine.triggers) if engine is not None else []
        return [*stages, *(TRIGGER_PREFIX + n for n in triggers)]

    @contextlib.contextmanager
    def _naming_every_pausable(self) -> Iterator[None]:
        """A refused stage name is answered with the triggers' names too."""
        from daemon.plane.stages import UnknownStageError

        try:
            yield
        except UnknownStageError as exc:
            raise UnknownStageError(exc.name, self._pausable(exc.names)) from None
