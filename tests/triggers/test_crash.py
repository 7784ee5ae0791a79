"""Pending retries survive a real SIGKILL of the process that queued them."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.triggers.crash_child import LSNS
from tests.triggers.support import Receiver, Reply
from triggers import Spec
from triggers.store import TriggerStore, store_path

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.crash


async def test_retries_pending_at_sigkill_are_delivered_after_restart(
    make_engine: Any, receiver: Receiver, tmp_path: Path
) -> None:
    """1. A child process's engine gets 500 for a chunk and queues it (10 min backoff).
    2. The child is SIGKILLed right after finish() returned.
    3. A new engine on the same data_dir starts: the entry is due at once and
       its retry loop delivers it, same rows and same idempotency keys."""
    data_dir = tmp_path / "data"
    receiver.default = Reply(500)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.triggers.crash_child", str(data_dir), receiver.url,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert child.stdout is not None
    try:
        line = b""
        while not line.startswith(b"QUEUED"):
            line = await asyncio.wait_for(child.stdout.readline(), timeout=60)
            assert line, "the child exited before queuing"
    finally:
        child.send_signal(signal.SIGKILL)
        assert await child.wait() == -signal.SIGKILL

    [first] = receiver.requests
    assert first.status == 500 and first.lsns == list(LSNS)
    survivor = TriggerStore(store_path(data_dir))
    [entry] = survivor.pending()
    survivor.close()
    assert entry.attempts == 1 and entry.next_due > time.time() + 60

    receiver.default = Reply(200)
    spec = Spec(name="hook", collection="orders", action={"type": "webhook", "url": receiver.url})
    with capture_logs() as logs:
        engine = await make_engine([spec], data_dir=data_dir, retry_loop=True, clock=time.time)
        for _ in range(200):
            if receiver.accepted():
                break
            await asyncio.sleep(0.025)

    [opened] = [x for x in logs if x["event"] == "trigger_store_opened"]
    assert opened["pending"] == 1 and opened["made_due"] == 1
    [again] = receiver.accepted()
    assert again.lsns == list(LSNS)
    assert again.headers["Idempotency-Key"] == first.headers["Idempotency-Key"] == "hook:101-103"
    assert [r["idempotency_key"] for r in again.body["rows"]] == [f"hook:{n}" for n in LSNS]
    # The receiver records before it answers: give the engine time to delete the entry.
    for _ in range(200):
        if engine.status()["retry_queue"]["depth"] == 0:
            break
        await asyncio.sleep(0.025)
    assert engine._store.pending() == [] and engine._store.dlq_size() == 0
