"""Real signals to a real daemon under load: clean drains, forced exits, reloads."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.integration.harness import (
    DaemonProcess,
    Loader,
    make_events,
    post_events,
    read_record,
    write_config,
)
from tests.integration.test_crash_recording import _wait_caught_up


def _delivered(record: Path) -> set[int]:
    return {lsn for d in read_record(record) for lsn, _ in d.rows}


def _log_events(daemon: DaemonProcess) -> list[dict[str, object]]:
    out = []
    for line in daemon.log_path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


@pytest.mark.crash
def test_sigterm_under_load_drains_and_exits_zero_with_every_ack_kept(tmp_path: Path) -> None:
    """
    1. Post from 4 producers; SIGTERM mid-load.
    2. The daemon exits 0 within its budget, after flushing watermarks.
    3. After a restart, every acknowledged event is delivered.
    """
    config = write_config(tmp_path, interval_ms=50)
    record = tmp_path / "delivered.log"
    daemon = DaemonProcess.recording(config, record).start()
    loader = Loader(daemon.ingest_url, producers=4)
    loader.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(timeout_s=30) == 0, daemon.tail()
    took = time.monotonic() - t0
    loader.stop()
    acked = loader.acked_lsns()
    assert acked, "no request was acknowledged before the signal"
    assert took < 10.0, f"drain took {took:.1f}s, over the 10 s budget"
    events = [e["event"] for e in _log_events(daemon)]
    assert "shutdown.requested" in events and "shutdown.done" in events

    daemon = DaemonProcess.recording(config, record).start()
    _wait_caught_up(daemon)
    assert daemon.stop() == 0
    assert not acked - _delivered(record)


@pytest.mark.crash
def test_second_signal_forces_a_fast_exit_and_loses_no_ack(tmp_path: Path) -> None:
    config = write_config(tmp_path, interval_ms=50)
    record = tmp_path / "delivered.log"
    daemon = DaemonProcess.recording(config, record).start()
    loader = Loader(daemon.ingest_url, producers=4)
    loader.start()
    time.sleep(0.5)
    daemon.signal(signal.SIGTERM)
    daemon.signal(signal.SIGINT)
    daemon.wait(timeout_s=30)
    loader.stop()
    acked = loader.acked_lsns()
    assert "shutdown.forced" in [e["event"] for e in _log_events(daemon)]

    daemon = DaemonProcess.recording(config, record).start()
    _wait_caught_up(daemon)
    assert daemon.stop() == 0
    assert not acked - _delivered(record)


def test_sighup_reloads_log_level(tmp_path: Path) -> None:
    config = write_config(tmp_path, log_level="info")
    daemon = DaemonProcess.recording(config, tmp_path / "delivered.log").start()
    try:
        config.write_text(config.read_text().replace('level = "info"', 'level = "debug"'))
        daemon.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done = [e for e in _log_events(daemon) if e["event"] == "reload.done"]
            if done:
                assert done[-1]["log_level"] == "debug"
                break
            time.sleep(0.1)
        else:
            pytest.fail("no reload.done after SIGHUP:\n" + daemon.tail())
    finally:
        assert daemon.stop() == 0


@pytest.mark.crash
@pytest.mark.spark
def test_sigterm_while_the_jvm_starts_exits_within_the_budget_with_every_ack_kept(
    tmp_path: Path,
) -> None:
    """
    1. A daemon with a CDC stream is ready (ingest open) before its JVM is.
    2. Ten requests are acknowledged, then SIGTERM, while the JVM still starts.
    3. It exits within shutdown_timeout_s + 3 s, not when the JVM's start ends,
       and names the worker thread it left; a restart keeps every ack.
    """
    extra = f'\n[[cdc.streams]]\nname = "all"\ncollections = "*"\npath = "{tmp_path / "t"}"\n'
    config = write_config(tmp_path, extra, shutdown_timeout_s=2.0)
    daemon = DaemonProcess.production(config).start()
    acked = [post_events(daemon.ingest_url, make_events(i * 10, 10)) for i in range(10)]
    assert not daemon.status()["spark"]["ready"], "the JVM was up before the test's SIGTERM"
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    daemon.wait(timeout_s=30)
    took = time.monotonic() - started
    assert took < 2.0 + 3.0, daemon.tail()
    assert any(e.get("event") == "shutdown.threads_left" for e in _log_events(daemon))
    again = DaemonProcess.production(config).start()
    try:
        assert again.status()["wal"]["head_lsn"] == acked[-1]["last_lsn"]
    finally:
        again.stop()
