"""Child process of the SIGKILL test: a trigger engine queues a failing webhook
call durably, prints QUEUED, and waits to be killed.

    python -m tests.triggers.crash_child <data_dir> <url>
"""

from __future__ import annotations

import asyncio
import sys

from tests.triggers.support import batch, event, hand_evaluation, webhook
from triggers import Retry, Spec, TriggerEngine

LSNS = (101, 102, 103)
# Ten minutes: no retry can happen before the kill; only the restart makes it due.
BACKOFF_MS = 600_000


async def main(data_dir: str, url: str) -> None:
    spec = Spec(
        name="hook", collection="orders", action=webhook(url),
        retry=Retry(max_attempts=5, initial_backoff_ms=BACKOFF_MS, max_backoff_ms=BACKOFF_MS),
    )  # fmt: skip
    engine = TriggerEngine([spec], data_dir=data_dir)
    await engine.start()
    events = [event(lsn, key=f"k{lsn}", new={"n": lsn}) for lsn in LSNS]
    await engine.finish(batch(7), hand_evaluation(engine, {"hook": events}))
    print("QUEUED", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
