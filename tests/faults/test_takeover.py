"""A standby takes over (docs/operating.md, "A standby"): real daemons, a real
SeaweedFS (tests/s3/server.py), real SIGKILL and SIGSTOP.

1. The primary SIGKILLed under load, ``ack = "archived"``, keyed producers
   given both endpoints, a Delta stream on S3 (real Spark): the standby takes
   over within the lease, every acknowledged event is in the table exactly
   once, no failover retry stored twice.
2. The primary SIGSTOPped past its lease (``ack = "local"``): the standby takes
   over; SIGCONT: the old primary acknowledges nothing more, and says why.
3. The store down when the takeover is due, or gone part-way through it: the
   standby waits (or tries again), says why, and takes over once it is back;
   retried requests answer their original LSNs.
4. A standby whose clock runs ahead takes over early: nothing acknowledged is
   lost or stored twice.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from daemon.client import IngestError, SyncIngestClient
from daemon.table.lease import ENV_CLOCK_OFFSET
from tests import requires
from tests.faults.receivers import Receiver
from tests.faults.support import healthz, spark_config, stage, wait_for
from tests.faults.test_wal_archive import SKEW_S, TTL_S, _post, _s3
from tests.integration.harness import DaemonProcess, make_events, write_config
from tests.s3.server import S3Server, Weed, start_weed
from wal import Wal

pytestmark = [pytest.mark.crash, pytest.mark.timeout(300)]


def _archive(server: S3Server, ack: str) -> str:
    return f"""{_s3(server)}
[wal.archive]
uri = "s3://{server.bucket}/takeover"
ack = "{ack}"
flush_ms = 50
poll_ms = 200
"""


def _archived_config(
    tmp_path: Path, server: S3Server, name: str, role: str, extra: str = "", **daemon: Any
) -> Path:
    """A daemon of ``role`` under ``tmp_path/name`` on the archive, ``ack = "archived"``
    (``extra`` and ``daemon`` as :func:`write_config` takes them)."""
    (tmp_path / name).mkdir()
    text = _archive(server, "archived").replace("poll_ms", f'role = "{role}"\npoll_ms')
    return write_config(tmp_path / name, text + extra, **daemon)


def _readyz(daemon: DaemonProcess) -> int:
    try:
        with urllib.request.urlopen(daemon.admin_url + "/readyz", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


class Producers:
    """Keyed producers given both endpoints (daemon.client): each ack's LSNs,
    the events' ``new.i``, and when and where it was acknowledged."""

    def __init__(self, urls: list[str], n: int = 2, batch: int = 50) -> None:
        self.urls, self.n, self.batch = urls, n, batch
        self.acks: list[tuple[float, str, int, int, bool, range]] = []
        self.failed: list[str] = []
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(p,)) for p in range(n)]

    def _run(self, p: int) -> None:
        client = SyncIngestClient(
            endpoints=self.urls, retry_for_s=90, max_wait_s=1.0, key_prefix=f"tk{p}"
        )
        i = p * 10_000_000
        with client:
            while not self._halt.is_set():
                try:
                    ack = client.send(make_events(i, self.batch))
                except IngestError as exc:
                    with self._lock:
                        self.failed.append(f"{exc.__class__.__name__}: {exc}")
                    return
                with self._lock:
                    self.acks.append(
                        (
                            time.monotonic(),
                            client.url,
                            ack.first_lsn,
                            ack.last_lsn,
                            ack.replayed,
                            range(i, i + self.batch),
                        )
                    )
                i += self.batch
                self._halt.wait(0.02)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._halt.set()
        for t in self._threads:
            t.join(timeout=120)

    def acked_lsns(self) -> set[int]:
        with self._lock:
            return {lsn for *_, a, b, _r, _i in self.acks for lsn in range(a, b + 1)}

    def first_ack_after(self, t: float, url: str) -> float | None:
        with self._lock:
            times = [at for at, where, *_ in self.acks if at > t and url in where]
        return min(times) if times else None


@pytest.mark.spark
def test_a_standby_takes_over_a_killed_primary_and_every_acknowledged_event_lands_once(
    tmp_path: Path,
) -> None:
    """1. A primary and a standby on one archive and one Delta stream on S3
       (lease_ttl_s 4, lease_skew_s 1); two keyed producers given both.
    2. The lake commits; the standby's copy of the archive follows.
    3. SIGKILL the primary: within the lease the standby restores the archive
       from its copy, fences it and opens ingest; the producers fail over.
    4. Every acknowledged LSN is in the table once, every event's ``new.i``
       once (no failover retry stored twice), batch ids above the old ones;
       every acknowledged row of the webhook trigger's collection delivered at
       least once with its key (the receiver refused them around the kill)."""
    from deltalake import DeltaTable

    requires.delta_jars()
    (tmp_path / "weed").mkdir()
    weed: Weed = start_weed(tmp_path / "weed")
    server = weed.server
    uri = f"s3://{server.bucket}/cdc/lake"
    receiver = Receiver()
    lake = f"""{_archive(server, "archived")}
[[cdc.streams]]
name = "lake"
collections = "*"
path = "{uri}"
format = "delta"

[[triggers]]
name = "hook"
collection = "c1"
action = {{ type = "webhook", url = "{receiver.url}" }}
retry = {{ max_attempts = 100000, initial_backoff_ms = 200, max_backoff_ms = 500 }}
"""

    def config(name: str, role: str) -> Path:
        (tmp_path / name).mkdir()
        text = lake.replace("flush_ms = 50\n", f'flush_ms = 50\nrole = "{role}"\n')
        path = spark_config(tmp_path / name, {}, extra=text)
        # The new primary's clean stop is asserted: 30 s for its Spark to stop
        # beside the suite's other JVMs (10 s ran out once, at load 9).
        path.write_text(
            path.read_text().replace("shutdown_timeout_s = 10.0", "shutdown_timeout_s = 30.0")
        )
        return path

    primary = DaemonProcess.production(config("a", "primary"))
    standby = DaemonProcess.production(config("b", "standby"), ready_path="/healthz")
    producers: Producers | None = None
    try:
        # Step 1. Both daemons, the producers
        primary.start(timeout_s=90)
        standby.start(timeout_s=60)
        producers = Producers([primary.ingest_url, standby.ingest_url])
        producers.start()
        # Step 2. The lake commits, the standby follows
        wait_for(
            "the lake commits",
            lambda: stage(primary.status(), "cdc:lake")["batch_id"] > 3,
            90,
            primary,
        )
        wait_for(
            "the standby follows",
            lambda: standby.status()["standby"]["follow"]["followed_lsn"] > 0,
            30,
            standby,
        )
        before = stage(primary.status(), "cdc:lake")["batch_id"]
        receiver.status = 503  # rows wait in the primary's retry queue at the kill
        time.sleep(1.0)
        # Step 3. SIGKILL
        killed_at = time.monotonic()
        primary.kill()
        wait_for("the standby takes over", lambda: _readyz(standby) == 200, 60, standby)
        took = time.monotonic() - killed_at
        first = wait_for(
            "an ack from the new primary",
            lambda: producers.first_ack_after(killed_at, standby.ingest_url) if producers else 0,
            60,
            standby,
        )
        receiver.status = 200
        time.sleep(2)  # acks from the new primary for a while
        producers.stop()
        assert not producers.failed, producers.failed[:3]
        acked = producers.acked_lsns()
        st = standby.status()
        assert st["role"] == "primary" and st["took_over"] is True, st
        head = st["wal"]["head_lsn"]
        assert head >= max(acked)
        wait_for(
            "the lake catches up",
            lambda: min(c["watermark"] for c in standby.status()["cores"]) >= head,
            90,
            standby,
        )
        assert stage(standby.status(), "cdc:lake")["batch_id"] > before
        # Every acknowledged row of c1 reaches the webhook, with its key.
        matching = {
            first + k
            for *_, first, _last, _replayed, events in producers.acks
            for k, i in enumerate(events)
            if i % 3 == 1
        }
        wait_for("every trigger row delivered", lambda: matching <= receiver.lsns(), 90, standby)
        keys = {(int(r["lsn"]), r["idempotency_key"]) for r in receiver.rows}
        assert {(lsn, f"hook:{lsn}") for lsn in matching} <= keys
        log = standby.log_path.read_text()
        assert '"event": "standby.took_over"' in log and '"event": "standby.restored"' in log
        assert standby.stop() == 0
        # Step 4. Exactly once
        rows = DeltaTable(uri, storage_options=server.storage_options()).to_pyarrow_table(
            columns=["lsn", "new_json"]
        )
        seen = Counter(rows["lsn"].to_pylist())
        assert acked <= set(seen), sorted(acked - set(seen))[:10]
        assert max(seen.values()) == 1, [k for k, v in seen.items() if v > 1][:10]
        ids = Counter(json.loads(text)["i"] for text in rows["new_json"].to_pylist())
        assert max(ids.values()) == 1, [k for k, v in ids.items() if v > 1][:10]
        sent = {i for *_, events in producers.acks for i in events}
        assert sent <= set(ids), sorted(sent - set(ids))[:10]
        print(
            f"takeover: ready {took:.1f} s after the SIGKILL, first ack at "
            f"{first - killed_at:.1f} s; {len(acked)} acknowledged, {len(seen)} rows"
        )
    finally:
        if producers is not None:
            producers.stop()
        primary.stop()
        standby.stop()
        receiver.close()
        weed.stop()


@pytest.mark.spark
def test_a_primary_stopped_past_its_lease_acknowledges_nothing_once_woken(
    tmp_path: Path,
) -> None:
    """1. A primary (``ack = "local"``, a Delta stream on S3) and a standby;
       events acknowledged, then SIGSTOP as soon as the standby has them.
    2. Past lease_ttl_s + lease_skew_s the standby takes over and
       acknowledges the next events.
    3. SIGCONT: the old primary answers 503 at once (its lease lapsed while it
       slept; a renewal finds the manifest taken) and health says why; nothing
       it stores after waking is acknowledged.
    4. The table holds each LSN once, LSN 21..30 the new primary's events:
       nothing the old primary wrote after the takeover."""
    from deltalake import DeltaTable

    requires.delta_jars()
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    uri = f"s3://{server.bucket}/cdc/lake"

    def config(name: str, role: str) -> Path:
        (tmp_path / name).mkdir()
        text = _archive(server, "local").replace("poll_ms", f'role = "{role}"\npoll_ms')
        text += f"""
[[cdc.streams]]
name = "lake"
collections = "*"
path = "{uri}"
format = "delta"
"""
        return spark_config(tmp_path / name, {}, extra=text, stall_after_s=2)

    primary = DaemonProcess.production(config("a", "primary"))
    standby = DaemonProcess.production(config("b", "standby"), ready_path="/healthz")
    try:
        # Step 1
        primary.start(timeout_s=90)
        standby.start(timeout_s=60)
        code, body, _ = _post(primary.ingest_url, n=20)
        assert code == 200 and body["ack"] == "local", body
        wait_for(
            "the standby follows",
            lambda: standby.status()["standby"]["follow"]["followed_lsn"] >= 20,
            30,
            standby,
        )
        # Step 2
        primary.signal(signal.SIGSTOP)
        wait_for("the standby takes over", lambda: _readyz(standby) == 200, 60, standby)
        code, body, _ = _post(standby.ingest_url, n=10, start=100)
        assert code == 200 and body["first_lsn"] == 21, body
        # Step 3
        primary.signal(signal.SIGCONT)
        code, body, _ = _post(primary.ingest_url, n=10, start=200)
        assert code == 503 and body["error"] == "not_primary", body
        assert "has not renewed the archive's manifest" in body["message"], body
        for k in range(5):
            code, body, _ = _post(primary.ingest_url, n=10, start=300 + 10 * k)
            assert code == 503, body
            time.sleep(0.3)
        _code, health = wait_for(
            "the old primary's health names the takeover",
            lambda: (lambda h: h if h[0] == 503 else None)(healthz(primary)),
            30,
            primary,
        )
        text = json.dumps(health)
        assert "taken over" in text or "fenced" in text or "has not renewed" in text, health
        assert standby.status()["wal"]["head_lsn"] == 30
        # Step 4
        wait_for(
            "the new primary's lake holds LSN 30",
            lambda: min(c["watermark"] for c in standby.status()["cores"]) >= 30,
            90,
            standby,
        )
        time.sleep(2)  # the old primary had its chance to commit
        primary.stop()
        assert standby.stop() == 0
        rows = DeltaTable(uri, storage_options=server.storage_options()).to_pyarrow_table(
            columns=["lsn", "new_json"]
        )
        seen = Counter(rows["lsn"].to_pylist())
        assert sorted(seen) == list(range(1, 31)) and max(seen.values()) == 1, seen
        by_lsn = dict(zip(rows["lsn"].to_pylist(), rows["new_json"].to_pylist(), strict=True))
        assert [json.loads(by_lsn[lsn])["i"] for lsn in range(21, 31)] == list(range(100, 110))
    finally:
        if primary.proc is not None and primary.proc.poll() is None:
            primary.signal(signal.SIGCONT)
        primary.stop()
        standby.stop()
        weed.stop()


_NEW_I = re.compile(rb'\{"i": ?(-?\d+), ?"amount"')


def _wal_events(wal_dir: Path) -> dict[int, int]:
    """LSN -> the event's ``new.i`` of every record in a stopped daemon's WAL."""
    wal = Wal.open(wal_dir)
    try:
        assert wal.retained_floor() == 1, f"the WAL retired LSNs below {wal.retained_floor()}"
        out = {}
        for rec in wal.read(wal.retained_floor()):
            found = _NEW_I.search(rec.payload)
            assert found, rec
            out[rec.lsn] = int(found[1])
        return out
    finally:
        wal.close()


def _keyed(url: str, key: str, start: int) -> tuple[int, dict[str, Any]]:
    body = b"".join(json.dumps(e).encode() + b"\n" for e in make_events(start, 10))
    headers = {"Content-Type": "application/x-ndjson", "Idempotency-Key": key}
    req = urllib.request.Request(url + "/v1/events", body, headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        exc.close()
        return exc.code, json.loads(raw)


def test_a_takeover_waits_out_a_store_outage_and_keeps_every_acknowledged_request(
    tmp_path: Path,
) -> None:
    """1. A primary (``ack = "archived"``) acknowledges three keyed requests.
    2. SIGKILL it and take the store away: past lease_ttl_s + lease_skew_s the
       standby is still a standby (it cannot read the manifest, let alone
       fence), and health names the archive.
    3. The store returns: the standby takes over, and a retry of each request
       answers its original LSNs (``replayed``), a new one the next LSN."""
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server

    def config(name: str, role: str) -> Path:
        return _archived_config(tmp_path, server, name, role, "\n[health]\nstall_after_s = 2\n")

    primary = DaemonProcess.production(config("a", "primary"))
    standby = DaemonProcess.production(config("b", "standby"), ready_path="/healthz")
    try:
        # Step 1
        primary.start(timeout_s=60)
        standby.start(timeout_s=60)
        acked = {}
        for n in range(3):
            code, body = _keyed(primary.ingest_url, f"req-{n}", 10 * n)
            assert code == 200 and body["ack"] == "archived", body
            acked[f"req-{n}"] = (body["first_lsn"], body["last_lsn"])
        # Step 2
        primary.kill()
        weed.stop()
        time.sleep(TTL_S + SKEW_S + 3)
        assert _readyz(standby) == 503
        code, health = healthz(standby)
        assert code == 503 and health["role"] == "standby", health
        assert "wal archive" in json.dumps(health), health
        # Step 3
        weed.start()
        wait_for("the standby takes over", lambda: _readyz(standby) == 200, 60, standby)
        for n in range(3):
            code, body = _keyed(standby.ingest_url, f"req-{n}", 10 * n)
            assert code == 200 and body.get("replayed") is True, body
            assert (body["first_lsn"], body["last_lsn"]) == acked[f"req-{n}"], body
        code, body = _keyed(standby.ingest_url, "req-new", 100)
        assert code == 200 and body["first_lsn"] == 31, body
        assert standby.stop() == 0
    finally:
        primary.stop()
        standby.stop()
        weed.stop()


def test_a_takeover_the_store_cuts_short_is_tried_again_and_keeps_every_acknowledged_request(
    tmp_path: Path,
) -> None:
    """1. A primary (``ack = "archived"``) acknowledges three keyed requests; the
       standby stops itself (``EVENTPLANE_PAUSE_AT``) in its takeover's restore,
       after the first object.
    2. SIGKILL the primary, delete the standby's copy of the archive (its
       restore must read the store), take the store away, SIGCONT: the restore
       fails part-way; the daemon stays a standby, and health says why.
    3. The store returns: the takeover is tried again and succeeds; a retry of
       each request answers its original LSNs, a new one the next LSN."""
    from daemon.follow import DIRNAME
    from daemon.table.crash import ENV_PAUSE_AT

    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server

    primary = DaemonProcess.production(_archived_config(tmp_path, server, "a", "primary"))
    standby = DaemonProcess.production(
        _archived_config(tmp_path, server, "b", "standby"),
        ready_path="/healthz",
        env={ENV_PAUSE_AT: "restore.mid_download"},
    )
    try:
        # Step 1
        primary.start(timeout_s=60)
        standby.start(timeout_s=60)
        acked = {}
        for n in range(3):
            code, body = _keyed(primary.ingest_url, f"req-{n}", 10 * n)
            assert code == 200 and body["ack"] == "archived", body
            acked[f"req-{n}"] = (body["first_lsn"], body["last_lsn"])
        wait_for(
            "the standby's copy holds every acknowledged event",
            lambda: standby.status()["standby"]["follow"]["followed_lsn"] >= 30,
            30,
            standby,
        )
        # Step 2
        primary.kill()
        wait_for(
            "the standby pauses in its restore",
            lambda: "pause point restore.mid_download" in standby.tail(200),
            TTL_S + SKEW_S + 30,
            standby,
        )
        for pack in (tmp_path / "b" / "data" / DIRNAME).iterdir():
            pack.unlink()
        weed.stop()
        standby.signal(signal.SIGCONT)
        wait_for(
            "health names the failed takeover",
            lambda: "cannot take over" in json.dumps(healthz(standby)[1]),
            30,
            standby,
        )
        assert _readyz(standby) == 503
        # Step 3
        weed.start()
        wait_for("the standby takes over", lambda: _readyz(standby) == 200, 60, standby)
        for n in range(3):
            code, body = _keyed(standby.ingest_url, f"req-{n}", 10 * n)
            assert code == 200 and body.get("replayed") is True, body
            assert (body["first_lsn"], body["last_lsn"]) == acked[f"req-{n}"], body
        code, body = _keyed(standby.ingest_url, "req-new", 100)
        assert code == 200 and body["first_lsn"] == 31, body
        assert standby.stop() == 0
    finally:
        primary.stop()
        standby.stop()
        weed.stop()


def test_a_standby_whose_clock_runs_ahead_may_take_over_early_but_loses_nothing(
    tmp_path: Path,
) -> None:
    """1. A primary (``ack = "archived"``) under keyed load given both endpoints;
       the standby's clock runs 3 s ahead (lease_skew_s is 1).
    2. SIGSTOP the primary: the standby, by its clock, sees the lease expired
       about 2 s after the last renewal, inside the lease, and takes over early.
    3. SIGCONT once it has (a primary woken first renews, and the standby
       rightly stands down: a race the pause alone left to the machine's
       speed): the old primary's next upload meets the new epoch's fence; it
       acknowledges nothing after it.
    4. Every acknowledgement, from either daemon, names LSNs whose events the
       new primary's WAL holds, each event once: the skew cost availability,
       never safety."""
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server

    def config(name: str, role: str) -> Path:
        # One segment for the whole run: step 4 reads every acknowledged LSN
        # from the new primary's WAL, which retires a segment once it is
        # archived and committed.
        return _archived_config(tmp_path, server, name, role, segment_bytes=64 << 20)

    primary = DaemonProcess.production(config("a", "primary"))
    standby = DaemonProcess.production(
        config("b", "standby"), ready_path="/healthz", env={ENV_CLOCK_OFFSET: "3"}
    )
    producers: Producers | None = None
    try:
        # Step 1
        primary.start(timeout_s=60)
        standby.start(timeout_s=60)
        producers = Producers([primary.ingest_url, standby.ingest_url], batch=20)
        producers.start()
        wait_for("acks", lambda: producers is not None and len(producers.acks) > 20, 30, primary)
        # Step 2
        primary.signal(signal.SIGSTOP)
        wait_for("the standby takes over", lambda: _readyz(standby) == 200, 60, standby)
        # Step 3
        primary.signal(signal.SIGCONT)
        time.sleep(2)
        producers.stop()
        assert not producers.failed, producers.failed[:3]
        _code, body, _ = wait_for(
            "the old primary knows it was taken over",
            lambda: (lambda r: r if r[0] == 503 else None)(_post(primary.ingest_url)),
            30,
            primary,
        )
        assert body["error"] == "not_primary", body
        archive = primary.status()["wal"]["archive"]
        assert archive["fenced"] and archive["lease"]["held"] is False, archive
        assert standby.stop() == 0
        # Step 4
        events = _wal_events(tmp_path / "b" / "data" / "wal")
        for _at, _url, first, last, _replayed, sent in producers.acks:
            assert [events.get(lsn) for lsn in range(first, last + 1)] == list(sent)
        counts = Counter(events.values())
        assert max(counts.values()) == 1, [i for i, c in counts.items() if c > 1][:10]
        log = standby.log_path.read_text()
        assert '"event": "standby.took_over"' in log
        # Early: by the true clock the lease had not expired (a right clock waits).
        took = [json.loads(line) for line in log.splitlines() if '"standby.takeover"' in line]
        assert took and took[0]["renewed_s_ago"] - 3 < TTL_S + SKEW_S, took
    finally:
        if producers is not None:
            producers.stop()
        for d in (primary, standby):
            if d.proc is not None and d.proc.poll() is None:
                d.signal(signal.SIGCONT)
            d.stop()
        weed.stop()
