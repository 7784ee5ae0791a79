"""The production daemon with a mirror that coalesces its merges
(``merge_interval_ms``), SIGKILLed between coalesced batches and at random,
then stopped cleanly with batches held: the mirror is the fold of the
acknowledged events, each batch in exactly one Delta commit.

1. ``merge_interval_ms = 400`` (batches every 100 ms: a few per merge); kill
   at ``mirror.coalesced@20`` (a batch held, its group not merged; coalesced
   merges committed before it), then once at a random moment under load.
2. Restart; re-send what got no answer (``Idempotency-Key``); wait until the
   mirror holds nothing and is level.
3. Restart with ``merge_interval_ms = 600000``; post, wait until the stage
   holds batches; stop it (SIGTERM): the clean stop merges them. A restart
   finds its progress recorded: it merges nothing again.
4. The mirror is the Python fold; the commits' batch ranges (``txn`` = the
   last) follow one another with no gap and no overlap.
"""

from __future__ import annotations

import itertools
import json
import random
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from daemon.table.crash import COALESCE_CRASH_POINTS
from tests.integration.harness import DaemonProcess, write_config
from tests.integration.test_crash_recording import _wait_caught_up
from tests.integration.test_mirror_crash import Producers, fold, post
from tests.table.test_mirror_coalesce import mirror_commits


def _config(tmp_path: Path, interval_ms: int) -> Path:
    extra = f"""
[[cdc.mirrors]]
name = "orders"
collection = "orders"
path = "{tmp_path / "mirror"}"
columns = {{ amount = "double", n = "long" }}
buckets = 4
merge_interval_ms = {interval_ms}
"""
    return write_config(tmp_path, cores=4, interval_ms=100, extra=extra)


def _stage(daemon: DaemonProcess) -> dict[str, Any]:
    return next(s for s in daemon.status()["stages"] if s["name"] == "mirror:orders")


def _wait(what: str, check: Any, daemon: DaemonProcess, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}:\n{daemon.tail()}"
        time.sleep(0.1)


@pytest.mark.crash
@pytest.mark.timeout(600)
def test_a_kill_between_coalesced_batches_and_a_clean_stop_lose_and_duplicate_nothing(
    tmp_path: Path,
) -> None:
    rng = random.Random(45)
    acked: list[tuple[int, list[dict[str, Any]]]] = []
    unanswered: list[tuple[str, list[dict[str, Any]]]] = []

    # Step 1. Killed between coalesced batches, then at random.
    config = _config(tmp_path, 400)
    for env in ({"EVENTPLANE_CRASH_AT": f"{COALESCE_CRASH_POINTS[0]}@20"}, {}):
        daemon = DaemonProcess.production(config, env=env).start(timeout_s=60)
        producers = Producers(daemon.ingest_url, rng)
        producers.start()
        try:
            if env:
                rc = daemon.wait(timeout_s=90)
                assert "crash point mirror.coalesced reached" in daemon.log_path.read_text()
                assert len(mirror_commits(tmp_path / "mirror")) >= 1, daemon.tail()
            else:
                time.sleep(rng.uniform(1.5, 2.5))
                daemon.kill()
                rc = -9
        finally:
            producers.stop()
        assert rc == -9, daemon.tail()
        acked += producers.acked
        unanswered += producers.unanswered

    # Step 2. Recovered, every request acknowledged, nothing held.
    daemon = DaemonProcess.production(config).start(timeout_s=60)
    for key, evs in unanswered:
        acked.append((post(daemon.ingest_url, evs, key), evs))
    _wait_caught_up(daemon, timeout_s=120)
    _wait(
        "the mirror did not level",
        lambda: (s := _stage(daemon))["held_batches"] == 0 and s["behind_batches"] == 0,
        daemon,
    )
    assert daemon.stop() == 0, daemon.tail()

    # Step 3. Held batches at a clean stop: merged, their progress recorded.
    config = _config(tmp_path, 600_000)
    daemon = DaemonProcess.production(config).start(timeout_s=60)
    for _ in range(5):
        evs = Producers.events(rng, 30)
        acked.append((post(daemon.ingest_url, evs, uuid.uuid4().hex), evs))
        time.sleep(0.15)
    # Every event in a batch (the consumers' lag counts from the watermarks,
    # which the held batches hold back: it is not 0 now).
    _wait(
        "no batch held", lambda: _delivered(daemon) and _stage(daemon)["held_batches"] >= 2, daemon
    )
    held = _stage(daemon)
    before = mirror_commits(tmp_path / "mirror")
    assert daemon.stop() == 0, daemon.tail()
    after = mirror_commits(tmp_path / "mirror")
    assert len(after) == len(before) + 1
    assert after[-1] == (held["batch_id"] + 1, held["batch_id"] + held["held_batches"])
    daemon = DaemonProcess.production(config).start(timeout_s=60)
    _wait("no status", lambda: _stage(daemon)["batch_id"] >= after[-1][1], daemon, 30)
    assert daemon.stop() == 0, daemon.tail()
    assert mirror_commits(tmp_path / "mirror") == after

    # Step 4. The fold; every batch in exactly one commit.
    got = {k: (r["lsn"], json.loads(r["doc"])) for k, r in _rows(tmp_path / "mirror").items()}
    want = fold(acked)
    assert got == want, (sorted(set(want) ^ set(got))[:5], len(got), len(want))
    assert after[0][0] == 1
    for prev, nxt in itertools.pairwise(after):
        assert nxt[0] == prev[1] + 1, (prev, nxt)
    coalesced = sum(1 for first, last in after if last > first)
    events = sum(len(e) for _, e in acked)
    assert coalesced >= 3 and events > 500, (after, events)
    print(
        f"coalesced mirror crash test: {events} events, {len(unanswered)} requests re-sent, "
        f"{after[-1][1]} batches in {len(after)} commits ({coalesced} coalesced)"
    )


def _delivered(daemon: DaemonProcess) -> bool:
    """Every event in the WAL is in a batch whose live run is over."""
    st = daemon.status()
    cores = st["cores"]
    done = (st.get("last_batch") or {}).get("state") in ("committed", "deferred")
    top = max(c["delivered_lsn"] for c in cores)
    return done and top == st["wal"]["head_lsn"] and not any(c["pending_rows"] for c in cores)


def _rows(path: Path) -> dict[str, dict[str, Any]]:
    from deltalake import DeltaTable

    rows = DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    out = {r["key"]: r for r in rows}
    assert len(out) == len(rows), "a key has two rows"
    return out
