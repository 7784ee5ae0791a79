"""The real daemon as systemd runs it: a subprocess with $NOTIFY_SOCKET and
$WATCHDOG_USEC, scraped, queried with `eventplane status`, stopped by SIGTERM."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import ROOT, DaemonProcess, post_events, write_config
from tests.service.conftest import Datagram, NotifyReceiver
from tests.service.test_metrics import DESIGN_SERIES

# 0.5 s watchdog: a ping every 0.25 s, so a few seconds show many.
WATCHDOG_USEC = 500_000


def _first(datagrams: list[Datagram], key: str) -> int:
    return next(i for i, d in enumerate(datagrams) if key in d.fields)


@pytest.fixture
def daemon(tmp_path: Path, notify_socket: NotifyReceiver) -> Iterator[DaemonProcess]:
    config = write_config(tmp_path, cores=2)
    env = {"NOTIFY_SOCKET": notify_socket.env_value, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    proc = DaemonProcess.production(config, env=env).start()
    yield proc
    proc.stop()


def test_daemon_speaks_notify_protocol_from_ready_to_stopping(
    daemon: DaemonProcess, notify_socket: NotifyReceiver
) -> None:
    """1. READY=1 arrives once the listeners answer, sent by the main process.
    2. WATCHDOG=1 pings keep arriving at about half of WATCHDOG_USEC, and a
       STATUS= line summarises the cores.
    3. SIGTERM: STOPPING=1 arrives, and the process exits 0."""
    assert daemon.proc is not None
    got = notify_socket.wait_for(lambda d: any("READY" in x.fields for x in d))
    ready = got[_first(got, "READY")]
    assert ready.sender_pid == daemon.proc.pid  # NotifyAccess=main would accept it

    start = time.monotonic()
    got = notify_socket.wait_for(lambda d: len([x for x in d if "WATCHDOG" in x.fields]) >= 6)
    pings = [x.received_at for x in got if "WATCHDOG" in x.fields]
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert max(gaps) < WATCHDOG_USEC / 1e6, f"a gap of {max(gaps):.3f}s would trip systemd"
    assert time.monotonic() - start < 10
    assert any("STATUS" in x.fields for x in got)

    daemon.signal(signal.SIGTERM)
    assert daemon.wait(timeout_s=30) == 0, daemon.tail()
    got = notify_socket.wait_for(lambda d: any("STOPPING" in x.fields for x in d))
    assert _first(got, "READY") < _first(got, "STOPPING")
    # Nothing claims readiness after the stop began.
    assert not any("READY" in x.fields for x in got[_first(got, "STOPPING") :])


def test_status_command_and_metrics_against_the_running_daemon(daemon: DaemonProcess) -> None:
    """1. Post events so the counters move.
    2. `eventplane status --url` prints the table and exits 0; `--json` follows
       the documented /v1/status shape.
    3. A scrape of /metrics has every documented series with its type."""
    post_events(daemon.ingest_url, [_event(i) for i in range(20)])
    cli = [sys.executable, "-m", "daemon.cli.main", "status", "--url", daemon.admin_url]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    table = subprocess.run(
        cli,
        cwd=daemon.config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert table.returncode == 0, table.stdout + table.stderr
    assert "eventplane  healthy, ready" in table.stdout
    assert "core  mode" in table.stdout

    raw = subprocess.run(
        [*cli, "--json"],
        cwd=daemon.config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    doc = json.loads(raw.stdout)
    assert {
        "healthy",
        "ready",
        "draining",
        "wal",
        "cores",
        "last_batch",
        "spark",
        "dlq",
        "retry_queue",
    } <= set(doc)
    assert {"head_lsn", "retained_floor", "segments"} <= set(doc["wal"])
    assert [c["core"] for c in doc["cores"]] == [0, 1]
    for core in doc["cores"]:
        assert {"mode", "watermark", "lag", "ring_fill", "backpressure", "catchup"} <= set(core)
    assert doc["wal"]["head_lsn"] >= 20

    with urllib.request.urlopen(daemon.admin_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind, _labels in DESIGN_SERIES:
        assert name in families, f"{name} missing from the daemon's /metrics"
        assert families[name].type == kind, name
    ingested = families["eventplane_ingest_events"].samples[0].value
    assert ingested >= 20


def test_daemon_logs_are_json_lines_when_not_on_a_terminal(daemon: DaemonProcess) -> None:
    assert daemon.stop() == 0
    lines = [x for x in daemon.log_path.read_text().splitlines() if x.strip()]
    records = [json.loads(x) for x in lines if x.startswith("{")]
    assert records, daemon.tail()
    for record in records:
        assert {"event", "level", "timestamp"} <= set(record), record
        assert record["timestamp"].endswith("Z")
    events = [r["event"] for r in records]
    assert "eventplane.ready" in events and "shutdown.done" in events


def _event(i: int) -> dict[str, object]:
    return {"collection": "orders", "op": "insert", "key": f"k{i}", "new": {"i": i}, "old": None}
