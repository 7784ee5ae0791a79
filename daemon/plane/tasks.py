"""Small asyncio helpers shared by the planner and the plane."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")


async def uncancellable(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion even if the caller is cancelled.

    File steps (write + fsync + rename) run in worker threads that a cancel
    cannot stop; the lock they hold must stay held until the thread is done,
    or a later step (a flush at shutdown, ``close``) would race the orphan.
    """
    task = asyncio.ensure_future(coro)
    task.add_done_callback(_retrieve)
    return await asyncio.shield(task)


def _retrieve(task: asyncio.Future[Any]) -> None:
    # A caller cancelled mid-step logs its own cancel; a failure after that
    # has nobody to raise to, so log it here instead of "never retrieved".
    if not task.cancelled() and task.exception() is not None:
        log.error("file_step_failed", error=repr(task.exception()))


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait for ``event`` at most ``seconds``; True if it was set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()
