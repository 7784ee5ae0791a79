"""No event stops a table (invariant 17), with a real daemon, real Spark and
real HTTP.

Events an older daemon acknowledged before ingest checked payloads (invalid
UTF-8, nesting deeper than the writer takes, a 1,001-digit number) are in the
WAL when this daemon starts: the streams that take them set them aside, every
other event reaches every table once, and health names the quarantine while
it stays 200.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from daemon.config import load
from daemon.events import StoredEvent, encode
from daemon.shard import core_of
from tests.faults.support import healthz, metric, spark_config, wait_for
from tests.integration.harness import ROOT, DaemonProcess, Loader
from wal.log import Wal

pytestmark = [pytest.mark.spark, pytest.mark.crash]

# What older daemons acknowledged and no CDC writer can parse, by collection.
OLD_POISON = [
    ("orders", b'{"note":"\xff\xfe"}'),
    ("users", b'{"a":' * 1001 + b"1" + b"}" * 1001),
    ("orders", b'{"total":' + b"9" * 1001 + b"}"),
]


def _lsns(spark: Any, path: Path, collection: str | None = None) -> Counter[int]:
    """Each LSN in the table at ``path`` (of ``collection`` only, if given), with its count."""
    if not list(path.glob("collection=*/*.parquet")):
        return Counter()
    df = spark.read.parquet(str(path))
    if collection is not None:
        df = df.where(df.collection == collection)
    return Counter(r.lsn for r in df.select("lsn").collect())


def _committed_lsn(daemon: DaemonProcess) -> int:
    """The LSN every stage has committed through (the lowest core watermark)."""
    return min(c["watermark"] for c in daemon.status()["cores"])


def _cli(config: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli.main", *argv, "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _append_as_an_older_daemon(config: Path) -> dict[int, str]:
    """The poison events, appended to the stopped daemon's WAL one request each,
    between clean ones; returns their LSNs and collections."""
    cfg = load(config)
    wal = Wal.open(cfg.wal_dir, segment_bytes=cfg.wal.segment_bytes)
    poison: dict[int, str] = {}
    try:
        for n, (collection, new) in enumerate(OLD_POISON):
            key = f"old-{n}"
            clean = StoredEvent(collection, "insert", f"ok-{n}", b'{"ok":1}', None, time.time_ns())
            bad = StoredEvent(collection, "insert", key, new, None, time.time_ns())
            wal.append_blocking([(core_of(collection, f"ok-{n}", cfg.daemon.cores), encode(clean))])
            lsn, _ = wal.append_blocking(
                [(core_of(collection, key, cfg.daemon.cores), encode(bad))]
            )
            poison[lsn] = collection
    finally:
        wal.close()
    return poison


@pytest.mark.timeout(600)
def test_events_no_table_can_hold_go_to_the_quarantine_and_every_other_event_lands_once(
    tmp_path: Path, spark: Any
) -> None:
    """1. A daemon with two streams, ``all`` (every collection) and ``orders``,
       takes clean events over HTTP and stops.
    2. Three poison events and three clean ones go into its WAL directly.
    3. It starts again and takes more clean events under load.
    4. ``all`` sets the three poison events aside, ``orders`` its two; every
       other event is in ``all`` once, and every other ``orders`` event in
       ``orders`` once; /healthz is 200 and names both
       quarantines; the gauge and ``eventplane status`` say so.
    5. ``eventplane cdc quarantine list all --json`` shows them with the
       writer's error; a purge through the running daemon empties ``orders``'s
       quarantine and its notice goes.
    """
    streams = {"all": tmp_path / "cdc" / "all", "orders": tmp_path / "cdc" / "orders"}
    config = spark_config(tmp_path, streams)
    text = config.read_text().replace(
        'name = "orders"\ncollections = "*"', 'name = "orders"\ncollections = ["orders"]'
    )
    config.write_text(text)
    daemon = DaemonProcess.production(config).start(timeout_s=120)
    try:
        wait_for("spark ready", lambda: daemon.status()["spark"]["ready"], 180, daemon)
        loader = Loader(daemon.ingest_url, batch=50, producers=1, pause_s=0.05)
        loader.start()
        time.sleep(1.0)
        loader.stop()
    finally:
        assert daemon.stop() == 0
    acked = loader.acked_lsns()
    assert acked

    poison = _append_as_an_older_daemon(config)  # Step 2

    daemon = DaemonProcess.production(config).start(timeout_s=120)
    try:
        wait_for("spark ready", lambda: daemon.status()["spark"]["ready"], 180, daemon)
        loader = Loader(daemon.ingest_url, batch=50, producers=2, pause_s=0.05)
        loader.start()
        time.sleep(2.0)
        loader.stop()
        acked |= loader.acked_lsns()
        wal_clean = {lsn - 1 for lsn in poison}  # the clean event before each poison one
        everything = acked | wal_clean
        orders_poison = {lsn for lsn, c in poison.items() if c == "orders"}

        def settled() -> bool:
            streams_status = daemon.status()["spark"]["streams"]
            return (
                streams_status["all"]["quarantined"] == len(poison)
                and streams_status["orders"]["quarantined"] == len(orders_poison)
                and _committed_lsn(daemon) >= max(everything)
            )

        wait_for("both streams commit past the poison", settled, 120, daemon)
        code, body = healthz(daemon)
        assert code == 200, body
        parts = sorted(n["part"] for n in body["notices"])
        assert parts == ["stream all", "stream orders"]
        assert metric(daemon, 'eventplane_cdc_quarantine_rows{stream="all"}') == len(poison)
        assert "3 rows in quarantine" in _cli(config, "status").stdout

        listed = json.loads(_cli(config, "cdc", "quarantine", "list", "all", "--json").stdout)
        assert sorted(r["lsn"] for r in listed) == sorted(poison)
        errors = {r["lsn"]: r["error"] for r in listed}
        assert all(e.startswith("new: ") for e in errors.values()), errors

        purge = _cli(config, "cdc", "quarantine", "purge", "orders", "--all", "--yes")
        assert purge.returncode == 0 and "purged 2 row(s)" in purge.stdout, purge.stderr
        code, body = healthz(daemon)
        assert code == 200 and [n["part"] for n in body["notices"]] == ["stream all"]
    finally:
        assert daemon.stop() == 0

    # Step 4, after a clean stop: each table holds each clean event once.
    table_all = _lsns(spark, streams["all"])
    assert set(table_all) == everything and max(table_all.values()) == 1
    assert not set(table_all) & set(poison)
    # ``orders`` holds exactly the clean events of its collection, each once.
    clean_orders = _lsns(spark, streams["all"], collection="orders")
    assert clean_orders and set(clean_orders) < everything
    table_orders = _lsns(spark, streams["orders"])
    assert set(table_orders) == set(clean_orders), set(clean_orders) ^ set(table_orders)
    assert max(table_orders.values()) == 1


# Hostile request bodies, one event each, by what is wrong with them: ingest
# refuses each with a 4xx (docs/ingest.md).
HOSTILE: dict[str, tuple[bytes, dict[str, str]]] = {
    "invalid UTF-8 in a value": (b'{"a":"\xff\xfe"}', {}),
    "invalid UTF-8 in a key": (b'{"\xff":1}', {}),
    "an encoded surrogate": (b'{"a":"\xed\xa0\x80"}', {}),
    "an overlong encoding": (b'{"a":"\xc0\xaf"}', {}),
    "an escaped lone surrogate": (b'{"a":"\\ud800"}', {}),
    "a raw control character": (b'{"a":"\x01"}', {}),
    "nesting 2,000 deep": (b'{"a":' * 2000 + b"1" + b"}" * 2000, {}),
    "a number of 1,001 digits": (b'{"a":' + b"9" * 1001 + b"}", {}),
    "a key of 50,001 characters": (b'{"' + b"k" * 50_001 + b'":1}', {}),
    "NaN": (b'{"a":NaN}', {}),
    "a gzip body that is not gzip": (b"{}", {"Content-Encoding": "gzip"}),
}


def _post_raw(url: str, new: bytes, headers: dict[str, str]) -> int:
    line = b'{"collection":"orders","op":"insert","key":"h","new":' + new + b"}\n"
    req = urllib.request.Request(
        url + "/v1/events",
        data=line,
        method="POST",
        headers={"Content-Type": "application/x-ndjson", **headers},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)


@pytest.mark.timeout(600)
def test_hostile_payloads_under_load_are_refused_and_clean_events_land_as_fast(
    tmp_path: Path, spark: Any
) -> None:
    """1. Clean load for 3 s; how long after the last ack the table holds
       every acknowledged event (the clean drain).
    2. The same load with every hostile class posted among it, many times:
       each one is answered with a 4xx, never a 2xx or a 5xx.
    3. The table holds every acknowledged event within twice the clean
       drain (plus a batch interval), each once, and nothing else: no
       hostile row, nothing quarantined; /healthz is 200 with no notice.
    """
    table = tmp_path / "cdc" / "all"
    daemon = DaemonProcess.production(spark_config(tmp_path)).start(timeout_s=120)
    acked: set[int] = set()

    def drain(loader: Loader) -> float:
        """From the last ack to the daemon's committed LSN passing every ack
        (its /v1/status: a table scan per poll would time the scans)."""
        loader.stop()
        acked.update(loader.acked_lsns())
        stopped = time.monotonic()
        last = max(acked)
        wait_for("every ack committed", lambda: _committed_lsn(daemon) >= last, 60, daemon)
        return time.monotonic() - stopped

    try:
        wait_for("spark ready", lambda: daemon.status()["spark"]["ready"], 180, daemon)
        loader = Loader(daemon.ingest_url, batch=100, producers=2, pause_s=0.02)
        loader.start()
        time.sleep(3.0)
        clean = drain(loader)  # Step 1

        loader = Loader(daemon.ingest_url, batch=100, producers=2, pause_s=0.02)
        loader.start()
        answers: dict[str, set[int]] = {kind: set() for kind in HOSTILE}
        until = time.monotonic() + 3.0
        while time.monotonic() < until:  # Step 2
            for kind, (new, headers) in HOSTILE.items():
                answers[kind].add(_post_raw(daemon.ingest_url, new, headers))
        dirty = drain(loader)

        wrong = {k: v for k, v in answers.items() if not all(400 <= s < 500 for s in v)}
        assert not wrong, wrong
        assert dirty <= 2 * clean + 0.2, (dirty, clean)  # Step 3
        code, body = healthz(daemon)
        assert code == 200 and "notices" not in body, body
        assert daemon.status()["spark"]["streams"]["all"]["quarantined"] == 0
    finally:
        assert daemon.stop() == 0
    rows = _lsns(spark, table)
    assert set(rows) == acked and max(rows.values()) == 1
