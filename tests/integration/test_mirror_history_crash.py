"""The production daemon with a history mirror (``history = true``), SIGKILLed
under load at each crash point of the mirror's commit and at random: the
mirror holds every version of the fold of the acknowledged events, each
exactly once (tests/integration/test_mirror_crash.py does the same for a
current-state mirror, whose machinery this reuses).

Scenario (one data dir throughout; mirrors only, so no JVM):
1. For each crash point of the mirror's commit, start the daemon with
   ``EVENTPLANE_CRASH_AT=<point>@3`` and post random inserts, updates and
   deletes of a few hundred keys until it kills itself there; then SIGKILL it
   at random moments under load, to ``KILLS`` lifetimes.
2. Start it once more, re-send every unanswered request with its
   ``Idempotency-Key``, wait until every batch committed, stop it.
3. The table's versions are the pure-Python fold of the acknowledged events
   in LSN order (per key, each insert or update opens a version the key's
   next event closes); no version twice, no batch id in two merges.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from daemon.table.crash import MIRROR_CRASH_POINTS
from tests.integration.harness import DaemonProcess, write_config
from tests.integration.test_crash_recording import _wait_caught_up
from tests.integration.test_mirror_crash import _lifetime, post

KILLS = 5
SOAK_KILLS = 40


def history_fold(
    acked: list[tuple[int, list[dict[str, Any]]]],
) -> dict[tuple[str, int], tuple[int | None, bool, Any]]:
    """(key, valid_from_lsn) -> (valid_to_lsn, is_current, new) of the orders
    collection after every acknowledged event, in LSN order."""
    by_lsn = {first + i: ev for first, evs in acked for i, ev in enumerate(evs)}
    assert len(by_lsn) == sum(len(evs) for _, evs in acked), "two events with one LSN"
    versions: dict[tuple[str, int], list[Any]] = {}
    current: dict[str, tuple[str, int]] = {}
    for lsn in sorted(by_lsn):
        ev = by_lsn[lsn]
        if ev["collection"] != "orders":
            continue
        held = current.pop(ev["key"], None)
        if held is not None:
            versions[held][:2] = [lsn, False]
        if ev["op"] != "delete":
            versions[(ev["key"], lsn)] = [None, True, ev["new"]]
            current[ev["key"]] = (ev["key"], lsn)
    return {k: (v[0], v[1], v[2]) for k, v in versions.items()}


@pytest.mark.crash
@pytest.mark.timeout(600)
def test_sigkill_at_the_history_mirror_commit_keeps_every_acked_version_exactly_once(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from deltalake import DeltaTable

    rng = random.Random(45)
    extra = f"""
[[cdc.mirrors]]
name = "orders"
collection = "orders"
path = "{tmp_path / "mirror"}"
columns = {{ amount = "double", n = "long" }}
buckets = 4
history = true
"""
    config = write_config(tmp_path, cores=4, interval_ms=100, extra=extra)
    acked: list[tuple[int, list[dict[str, Any]]]] = []
    unanswered: list[tuple[str, list[dict[str, Any]]]] = []
    budget = SOAK_KILLS if request.config.getoption("--soak") else KILLS
    points = list(MIRROR_CRASH_POINTS)
    for kills in range(budget):  # Step 1.
        env = {"EVENTPLANE_CRASH_AT": f"{points[kills]}@3"} if kills < len(points) else {}
        producers, _ = _lifetime(config, rng, env)
        acked += producers.acked
        unanswered += producers.unanswered
    assert sum(len(e) for _, e in acked) > 1_000, "the load was too light to prove anything"

    daemon = DaemonProcess.production(config).start(timeout_s=60)  # Step 2.
    for key, evs in unanswered:
        acked.append((post(daemon.ingest_url, evs, key), evs))
    _wait_caught_up(daemon, timeout_s=120)
    stage = next(s for s in daemon.status()["stages"] if s["name"] == "mirror:orders")
    assert not stage["failing"], stage
    assert daemon.stop() == 0, daemon.tail()

    table = DeltaTable(str(tmp_path / "mirror"))  # Step 3.
    rows = table.to_pyarrow_table().to_pylist()
    got = {
        (r["key"], r["valid_from_lsn"]): (r["valid_to_lsn"], r["is_current"], json.loads(r["doc"]))
        for r in rows
    }
    assert len(got) == len(rows), "a version is in the table twice"
    want = history_fold(acked)
    missing = sorted(set(want) - set(got))[:5]
    extra_rows = sorted(set(got) - set(want))[:5]
    assert got == want, f"missing {missing}, extra {extra_rows}"
    merges = [
        json.loads(h["userMetadata"])["eventplane"]["batch_id"]
        for h in table.history()
        if h.get("operation") == "MERGE"
    ]
    assert len(merges) == len(set(merges)) and merges, "a batch merged twice"
    print(
        f"history mirror crash test: {budget} kills, {sum(len(e) for _, e in acked)} events, "
        f"{len(unanswered)} requests re-sent, {len(merges)} merges, {len(want)} versions"
    )
