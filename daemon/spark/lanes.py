"""Each stage's own thread (its *lane*), and how long a batch waits for it.

A stage whose work on its table may hang on the store (a CDC stream's
commit, a mirror's merge and its compaction) runs that work in a lane of its
own, one call at a time. The batch waits for a call at most ``wait_s`` (half
of ``health.attempt_slow_s``): one still running then goes on in its lane and
is handed back as :class:`~daemon.plane.batch.InFlight` (:func:`hand_back`),
so a stage hung on its store holds back only itself (invariant 6). Both
executors use it (:mod:`daemon.spark.executor`, :mod:`daemon.spark.mirrors`).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from daemon.plane.batch import InFlight


class Lane:
    """One stage's own thread: its calls run here one at a time.

    A daemon thread, not a ``ThreadPoolExecutor``: the process must be able to
    exit while a request still hangs (each is bounded by the ``[s3]``
    timeouts, and the lease fences a commit that lands late, invariant 18).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Future[Any], str, Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        # What the running call does and since when (monotonic); None when idle.
        self.running: tuple[str, float] | None = None

    def submit(self, what: str, call: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"eventplane-lane-{self.name}", daemon=True
            )
            self._thread.start()
        self._queue.put((future, what, call))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, what, call = item
            if not future.set_running_or_notify_cancel():
                continue
            self.running = (what, time.monotonic())
            try:
                future.set_result(call())
            except BaseException as exc:  # handed to the waiter, never lost
                future.set_exception(exc)
            finally:
                self.running = None

    def busy(self) -> bool:
        return self.running is not None or not self._queue.empty()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)


class Lanes:
    """The lanes of an executor's stages, by stage name, each made on first use."""

    def __init__(self) -> None:
        self._lanes: dict[str, Lane] = {}

    def submit(self, stage: str, what: str, call: Callable[[], Any]) -> Future[Any]:
        """Run ``call`` (described by ``what``, for health) in ``stage``'s lane,
        after the calls queued there, in a copy of the caller's context."""
        lane = self._lanes.setdefault(stage, Lane(stage))
        return lane.submit(what, functools.partial(contextvars.copy_context().run, call))

    def busy(self, stage: str) -> bool:
        lane = self._lanes.get(stage)
        return lane is not None and lane.busy()

    def waiting_for(self, stage: str) -> str | None:
        """What ``stage``'s running call does and for how long, or None when idle."""
        lane = self._lanes.get(stage)
        running = lane.running if lane is not None else None
        if running is None:
            return None
        what, since = running
        return f"{what}, running for {time.monotonic() - since:.1f} s"

    def close(self) -> None:
        """End each lane's thread once its queued calls are over."""
        for lane in self._lanes.values():
            lane.close()


def outlives(future: Future[Any], wait_s: float) -> bool:
    """Wait for ``future`` at most ``wait_s`` (infinity: until it is done);
    True when it is still running then."""
    timeout = None if wait_s == float("inf") else max(wait_s, 0.0)
    concurrent.futures.wait([future], timeout=timeout)
    return not future.done()


def hand_back(
    stage: str, batch_id: int, running: Future[Any], landed: Callable[[Future[Any]], None]
) -> InFlight:
    """The marker of ``stage``'s attempt at ``batch_id`` that goes on in its
    lane; its ``done`` resolves once the attempt is over, after the executor's
    own bookkeeping (``landed(running)``, in the lane's thread)."""
    done: Future[None] = Future()
    done.set_running_or_notify_cancel()

    def over(f: Future[Any]) -> None:
        try:
            landed(f)
        finally:
            exc = f.exception()
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)

    running.add_done_callback(over)
    return InFlight(stage, batch_id, done)
