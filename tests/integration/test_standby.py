"""A standby daemon (``[wal.archive] role = "standby"``) and a primary against a
real SeaweedFS (tests/s3/server.py): a standby acknowledges nothing and names
the primary (invariant 21), producers given both land on the primary once,
and a second primary is refused at start (docs/operating.md, "A standby").
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.faults.support import healthz, wait_for
from tests.integration.harness import ROOT, DaemonProcess, make_events, write_config
from tests.s3.server import S3Server

pytestmark = [pytest.mark.timeout(180)]
EVENTPLANE = ROOT / ".venv" / "bin" / "eventplane"
# A short lease: the standby reads the manifest every (ttl - skew) / 3 = 1 s.
TTL_S, SKEW_S = 4.0, 1.0


def _config(directory: Path, server: S3Server, prefix: str, role: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    extra = f"""
[s3]
endpoint = "{server.endpoint}"
path_style = true
access_key_id = "{server.access_key}"
secret_access_key = "{server.secret_key}"
connect_timeout_s = 1
request_timeout_s = 1
max_retries = 0
lease_ttl_s = {TTL_S}
lease_skew_s = {SKEW_S}

[wal.archive]
uri = "s3://{server.bucket}/{prefix}"
role = "{role}"
flush_ms = 50
"""
    return write_config(directory, extra)


def _get(url: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    return _call(urllib.request.Request(url))


def _post(url: str, n: int = 5) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = b"".join(json.dumps(e).encode() + b"\n" for e in make_events(0, n))
    headers = {"Content-Type": "application/x-ndjson", "Idempotency-Key": "standby-1"}
    return _call(urllib.request.Request(url + "/v1/events", body, headers, method="POST"))


def _call(req: urllib.request.Request) -> tuple[int, dict[str, Any], dict[str, str]]:
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as exc:
        raw, headers = exc.read(), dict(exc.headers)
        exc.close()
        return exc.code, json.loads(raw), headers


def test_a_standby_acknowledges_nothing_names_the_primary_and_send_lands_on_the_primary_once(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """1. The standby starts first: no daemon holds the archive, so its 503 standby
       (with Retry-After) names no primary; /readyz 503, /healthz 200 with its role.
    2. The primary starts and takes the manifest; within the standby's next read of
       it, the standby's answers name the primary's host.
    3. /v1/status and `eventplane status` show each one's role.
    4. `eventplane send --url STANDBY --url PRIMARY`: every event lands on the
       primary once, each request under its one key; the standby has no WAL.
    5. The primary stops cleanly (its manifest released): the standby names none."""
    host = socket.gethostname()
    standby = DaemonProcess.production(
        _config(tmp_path / "b", s3_server, "standby", "standby"), ready_path="/healthz"
    )
    primary = DaemonProcess.production(_config(tmp_path / "a", s3_server, "standby", "primary"))
    try:
        # Step 1. The standby alone
        standby.start(timeout_s=60)
        code, body, headers = _post(standby.ingest_url)
        assert code == 503 and body["error"] == "standby", body
        assert body["primary"] is None and headers.get("Retry-After") == "1", (body, headers)
        code, ready, _ = _get(standby.admin_url + "/readyz")
        assert code == 503 and ready["role"] == "standby", ready
        code, health = healthz(standby)
        assert code == 200 and health["role"] == "standby", health
        # Step 2. The primary takes the archive; the standby names it
        primary.start(timeout_s=60)
        body = wait_for(
            "the standby names the primary",
            lambda: (lambda r: r[1] if r[1].get("primary") else None)(_post(standby.ingest_url)),
            15,
            standby,
        )
        assert body["primary"] == host and body["error"] == "standby", body
        assert "acknowledges nothing; nothing was stored" in body["message"], body
        # Step 3. Status
        st = standby.status()
        assert st["role"] == "standby" and st["ready"] is False and st["wal"] is None, st
        assert st["standby"]["primary"] == host and st["standby"]["held"] is True, st
        assert st["standby"]["holder"]["pid"] == primary.proc.pid  # type: ignore[union-attr]
        assert primary.status()["role"] == "primary"
        assert healthz(primary)[1]["role"] == "primary"
        table = subprocess.run(
            [str(EVENTPLANE), "status", "--url", standby.admin_url],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
        )
        assert table.returncode == 0, table.stderr
        assert "eventplane  healthy, not ready, standby" in table.stdout
        assert f"standby     primary {host} pid {primary.proc.pid}, epoch 1" in table.stdout  # type: ignore[union-attr]
        # Step 4. send, standby first
        stdin = b"".join(json.dumps(e).encode() + b"\n" for e in make_events(0, 20))
        sent = subprocess.run(
            [
                str(EVENTPLANE),
                "send",
                "--url",
                standby.ingest_url,
                "--url",
                primary.ingest_url,
                "--batch",
                "5",
                "--key-prefix",
                "fo",
            ],
            input=stdin,
            capture_output=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert sent.returncode == 0, sent.stderr.decode()
        out = sent.stdout.decode()
        assert out.startswith("sent 20 events in 4 requests (1 retried), LSN 1..20, "), out
        assert f"attempt 2 at {primary.ingest_url}/v1/events in 0.0 s" in sent.stderr.decode()
        wal = primary.status()["wal"]
        assert wal["head_lsn"] == 20 and wal["idempotency_keys"] == 4, wal
        assert not (tmp_path / "b" / "data" / "wal").exists()
        # Step 5. A clean stop releases the manifest: the standby names no primary
        assert primary.stop() == 0
        wait_for(
            "the standby names no primary",
            lambda: (lambda r: r[0] == 503 and r[1]["primary"] is None)(_post(standby.ingest_url)),
            15,
            standby,
        )
        assert standby.status()["standby"]["held"] is False
        assert standby.stop() == 0
    finally:
        standby.stop()
        primary.stop()


def test_a_second_primary_is_refused_at_start_naming_the_holder(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """1. Primary A holds the archive's manifest.
    2. A's WAL is copied to another data_dir (the same WAL id, as a copy or a
       restore would have), and a daemon started there as primary too.
    3. It exits 1 at start: the manifest is held by A (host, pid, data_dir), with
       the way out.
    4. A primary on an empty data_dir is refused too, naming A; A goes on taking
       events, unfenced."""
    first = DaemonProcess.production(_config(tmp_path / "a", s3_server, "twice", "primary"))
    second = DaemonProcess.production(_config(tmp_path / "b", s3_server, "twice", "primary"))
    try:
        first.start(timeout_s=60)
        assert _post(first.ingest_url)[0] == 200
        shutil.copytree(
            tmp_path / "a" / "data" / "wal",
            tmp_path / "b" / "data" / "wal",
            ignore=lambda _d, names: [n for n in names if n == "LOCK"],
        )
        with pytest.raises(RuntimeError, match="daemon exited with 1"):
            second.start(timeout_s=60)
        log = (tmp_path / "b" / "daemon.log").read_text()
        assert "has a primary already: its manifest is held by " in log, second.tail()
        pid = first.proc.pid  # type: ignore[union-attr]
        holder = f"{socket.gethostname()} pid {pid} (data_dir {tmp_path / 'a' / 'data'}), epoch 1"
        assert holder in log
        assert "One primary per archive: stop that daemon first" in log
        assert "start this one as its standby ([wal.archive] role = " in log
        # Step 4. On an empty data_dir too, the refusal names the live holder.
        empty = DaemonProcess.production(_config(tmp_path / "c", s3_server, "twice", "primary"))
        with pytest.raises(RuntimeError, match="daemon exited with 1"):
            empty.start(timeout_s=60)
        log = (tmp_path / "c" / "daemon.log").read_text()
        assert "holds no WAL, but the archive " in log, empty.tail()
        assert f"its manifest is held now by {holder}, the archive's primary" in log
        assert not (tmp_path / "c" / "data" / "wal").exists()
        code, body, _ = _post(first.ingest_url)
        assert code == 200 and body["replayed"] is True, body  # the same key, still served
        assert first.status()["wal"]["archive"]["fenced"] is None
        assert first.stop() == 0
    finally:
        second.stop()
        first.stop()
