"""Idempotent requests across a real daemon's SIGKILL (invariant 15): a key acknowledged
before the kill is still recognised after the restart, with the LSNs it got first, and
its retry stores nothing; keys of segments removed by retention are kept too."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.integration.harness import DaemonProcess, make_events, write_config


def post(url: str, body: bytes, key: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(
        url + "/v1/events",
        data=body,
        method="POST",
        headers={"Content-Type": "application/x-ndjson", "Idempotency-Key": key},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), json.loads(exc.read())


def ndjson(events: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in events)


def test_keys_acknowledged_before_a_sigkill_are_replayed_after_the_restart(
    tmp_path: Path,
) -> None:
    # Tiny segments and a fast watermark flush: retention removes segments that held
    # keys while the daemon runs, so some keys come back from wal/REQUESTS.
    config = write_config(
        tmp_path,
        cores=2,
        segment_bytes=1 << 20,
        extra="[consumer]\nwatermark_flush_ms = 100\n",
    )
    daemon = DaemonProcess.production(config).start()
    bodies = {f"req-{i}": ndjson(make_events(i * 1000, 1000)) for i in range(30)}
    try:
        first = {}
        for key, body in bodies.items():
            status, _, ack = post(daemon.ingest_url, body, key)
            assert status == 200 and "replayed" not in ack, ack
            first[key] = ack
        head = first["req-29"]["last_lsn"]
        deadline = time.monotonic() + 30
        while daemon.status()["wal"]["retained_floor"] <= first["req-0"]["last_lsn"]:
            assert time.monotonic() < deadline, "retention removed no keyed segment"
            time.sleep(0.1)
        daemon.kill()
        daemon.start()
        for key, body in bodies.items():
            status, headers, ack = post(daemon.ingest_url, body, key)
            assert status == 200, ack
            assert ack == {**first[key], "replayed": True}, key
            assert headers.get("Idempotent-Replayed") == "true"
        status, _, err = post(daemon.ingest_url, ndjson(make_events(0, 1)), "req-3")
        assert status == 422 and err["error"] == "idempotency_key_reused"
        assert daemon.status()["wal"]["head_lsn"] == head, "a retry stored events again"
    finally:
        daemon.stop()
