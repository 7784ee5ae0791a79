"""The production daemon with a mirror, SIGKILLed under load: the mirror is the
fold of the acknowledged events, each applied exactly once.

Scenario (one data dir throughout; the daemon has only a mirror, so no JVM):
1. For each crash point of the mirror's commit, start the daemon with
   ``EVENTPLANE_CRASH_AT=<point>@3`` (two batches commit first) and post
   random inserts, updates and deletes of a few hundred keys (re-inserts,
   updates and deletes of keys the mirror does not hold among them) until the
   daemon kills itself there.
2. Then SIGKILL it at random moments under load, to ``KILLS`` lifetimes.
3. Start it once more; re-send every request that got no answer with its
   ``Idempotency-Key`` (one that was stored answers its original LSNs, one
   that was not is stored now), so that every event sent is acknowledged
   with its LSN; wait until every batch committed; stop it.
   Then pause the mirror's stage: it takes nothing and says so; resume it.
4. The mirror, read by delta-rs, Polars and DuckDB over delta-rs, is the
   Python fold of those events in LSN order; each batch id is in at most one
   of its Delta commits.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from daemon.table.crash import MIRROR_CRASH_POINTS
from tests.integration.harness import DaemonProcess, write_config
from tests.integration.test_crash_recording import _wait_caught_up

# Daemon lifetimes, the named crash points included (one takes 5-10 s on a
# busy machine);
# `--soak` runs SOAK_KILLS.
KILLS = 6
SOAK_KILLS = 60
KEYS = 300


def _config(tmp_path: Path) -> Path:
    extra = f"""
[[cdc.mirrors]]
name = "orders"
collection = "orders"
path = "{tmp_path / "mirror"}"
columns = {{ amount = "double", n = "long" }}
buckets = 4
"""
    return write_config(tmp_path, cores=4, interval_ms=100, extra=extra)


class Producers(threading.Thread):
    """Posts random requests until stopped; keeps each request's events with
    its answer's LSNs, or, unanswered, with its Idempotency-Key to re-send."""

    def __init__(self, url: str, rng: random.Random, threads: int = 3) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.threads = threads
        self.seeds = [rng.randrange(2**32) for _ in range(threads)]
        self.acked: list[tuple[int, list[dict[str, Any]]]] = []  # (first LSN, events)
        self.unanswered: list[tuple[str, list[dict[str, Any]]]] = []
        self._lock = threading.Lock()
        self._halt = threading.Event()

    @staticmethod
    def events(rng: random.Random, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            op = rng.choice(["insert", "update", "update", "delete"])
            amount: Any = rng.choice([rng.randint(-500, 500), rng.random() * 100, "x"])
            out.append(
                {
                    "collection": rng.choice(["orders", "orders", "orders", "other"]),
                    "op": op,
                    "key": f"k{rng.randrange(KEYS)}",
                    "new": None if op == "delete" else {"amount": amount, "n": rng.randint(0, 9)},
                }
            )
        return out

    def _produce(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._halt.is_set():
            evs = self.events(rng, rng.randint(1, 40))
            key = uuid.uuid4().hex
            try:
                first = post(self.url, evs, key)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                with self._lock:
                    self.unanswered.append((key, evs))
                if self._halt.wait(0.05):
                    return
                continue
            with self._lock:
                self.acked.append((first, evs))
            self._halt.wait(0.01)

    def run(self) -> None:
        workers = [threading.Thread(target=self._produce, args=(s,)) for s in self.seeds]
        for t in workers:
            t.start()
        for t in workers:
            t.join()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)


def post(url: str, evs: list[dict[str, Any]], idempotency_key: str) -> int:
    body = b"\n".join(json.dumps(e).encode() for e in evs) + b"\n"
    req = urllib.request.Request(
        url + "/v1/events",
        data=body,
        method="POST",
        headers={"Content-Type": "application/x-ndjson", "Idempotency-Key": idempotency_key},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        answer = json.loads(r.read())
    assert answer["last_lsn"] - answer["first_lsn"] + 1 == len(evs)
    return int(answer["first_lsn"])


def admin(daemon: DaemonProcess, action: str) -> None:
    url = f"{daemon.admin_url}/v1/stages/mirror:orders/{action}"
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def fold(acked: list[tuple[int, list[dict[str, Any]]]]) -> dict[str, tuple[int, Any]]:
    """key -> (LSN, new) of the orders collection after every event, in LSN order."""
    by_lsn = {first + i: ev for first, evs in acked for i, ev in enumerate(evs)}
    assert len(by_lsn) == sum(len(evs) for _, evs in acked), "two events with one LSN"
    state: dict[str, tuple[int, Any]] = {}
    for lsn in sorted(by_lsn):
        ev = by_lsn[lsn]
        if ev["collection"] != "orders":
            continue
        if ev["op"] == "delete":
            state.pop(ev["key"], None)
        else:
            state[ev["key"]] = (lsn, ev["new"])
    return state


def _progress(daemon: DaemonProcess) -> int:
    stages = daemon.status().get("stages") or []
    return next((int(s["batch_id"]) for s in stages if s["name"] == "mirror:orders"), 0)


def _wait_committed(daemon: DaemonProcess, batch_id: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _progress(daemon) < batch_id:
        assert time.monotonic() < deadline, f"no batch committed:\n{daemon.tail()}"
        time.sleep(0.05)


def _lifetime(config: Path, rng: random.Random, env: dict[str, str]) -> tuple[Producers, int]:
    daemon = DaemonProcess.production(config, env=env).start(timeout_s=60)
    producers = Producers(daemon.ingest_url, rng)
    producers.start()
    try:
        if env:
            rc = daemon.wait(timeout_s=60)
        else:
            # Once a batch committed in this lifetime: a kill with batches in flight.
            _wait_committed(daemon, _progress(daemon) + 1)
            time.sleep(rng.uniform(0.05, 0.6))
            daemon.kill()
            rc = -9
    finally:
        producers.stop()
    assert rc == -9, f"{env}: expected death by SIGKILL, got {rc}\n{daemon.tail()}"
    if env:
        point = env["EVENTPLANE_CRASH_AT"].partition("@")[0]
        assert f"crash point {point} reached" in daemon.log_path.read_text()
    return producers, rc


@pytest.mark.crash
@pytest.mark.timeout(600)
def test_sigkill_at_the_mirror_commit_and_at_random_leaves_the_fold_of_acked_events(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    import duckdb
    import polars as pl
    from deltalake import DeltaTable

    rng = random.Random(44)
    config = _config(tmp_path)
    acked: list[tuple[int, list[dict[str, Any]]]] = []
    unanswered: list[tuple[str, list[dict[str, Any]]]] = []
    budget = SOAK_KILLS if request.config.getoption("--soak") else KILLS
    points = [p for p in MIRROR_CRASH_POINTS]
    kills = 0
    # Steps 1-2. The named crash points, then random moments.
    while kills < budget:
        env = {"EVENTPLANE_CRASH_AT": f"{points[kills]}@3"} if kills < len(points) else {}
        producers, _ = _lifetime(config, rng, env)
        acked += producers.acked
        unanswered += producers.unanswered
        kills += 1
    assert sum(len(e) for _, e in acked) > 2_000, "the load was too light to prove anything"

    # Step 3. Recover; every request sent is acknowledged with its LSNs.
    daemon = DaemonProcess.production(config).start(timeout_s=60)
    for key, evs in unanswered:
        acked.append((post(daemon.ingest_url, evs, key), evs))
    _wait_caught_up(daemon, timeout_s=120)
    # Paused, the mirror takes nothing and says so; resumed, it catches up.

    version = DeltaTable(str(tmp_path / "mirror")).version()
    admin(daemon, "pause")
    more = Producers.events(rng, 40)
    acked.append((post(daemon.ingest_url, more, uuid.uuid4().hex), more))
    time.sleep(1.0)
    stage = next(s for s in daemon.status()["stages"] if s["name"] == "mirror:orders")
    assert stage["paused"] and stage["behind_batches"] >= 1, stage
    assert DeltaTable(str(tmp_path / "mirror")).version() == version
    admin(daemon, "resume")
    _wait_caught_up(daemon, timeout_s=120)
    status = daemon.status()
    stage = next(s for s in status["stages"] if s["name"] == "mirror:orders")
    assert not stage["failing"] and not stage["paused"], stage
    assert status["spark"]["mirrors"]["orders"]["cast_failures"]["amount"] > 0
    assert daemon.stop() == 0, daemon.tail()

    # Step 4. The mirror is the fold, for every reader.
    want = fold(acked)
    path = str(tmp_path / "mirror")
    table = DeltaTable(path)
    rows = table.to_pyarrow_table().to_pylist()
    got = {r["key"]: (r["lsn"], json.loads(r["doc"])) for r in rows}
    assert len(got) == len(rows), "a key has two rows"
    missing = sorted(set(want) - set(got))[:5]
    extra = sorted(set(got) - set(want))[:5]
    assert got == want, f"missing {missing}, extra {extra}"
    for r in rows:
        amount = json.loads(r["doc"])["amount"]
        assert r["amount"] == (None if amount == "x" else float(amount))
    live = len(want)
    assert pl.read_delta(path).height == live
    con = duckdb.connect()
    con.register("orders", table.to_pyarrow_dataset())
    assert con.execute("SELECT count(*), count(DISTINCT key) FROM orders").fetchone() == (
        live,
        live,
    )
    # Exactly once: no batch id in two merges.
    merges = [
        json.loads(h["userMetadata"])["eventplane"]["batch_id"]
        for h in table.history()
        if h.get("operation") == "MERGE"
    ]
    assert len(merges) == len(set(merges)) and merges, "a batch merged twice"
    print(
        f"mirror crash test: {kills} kills, {sum(len(e) for _, e in acked)} events, "
        f"{len(unanswered)} requests re-sent, {len(merges)} merges, {live} live keys"
    )
