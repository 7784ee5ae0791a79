"""SIGHUP adds the first trigger to a daemon that started without any, and
removes it again; without Spark at all it says a restart is needed."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import DaemonProcess, post_events, webhook_trigger, write_config
from tests.integration.test_cdc_crash import _wait_spark_ready
from tests.integration.test_crash_recording import _wait_caught_up
from tests.integration.test_triggers_daemon import Receiver, _wait_for


def _stream(table: Path) -> str:
    return f"""
[spark]
master = "local[1]"
log_level = "ERROR"

[[cdc.streams]]
name = "all"
collections = "*"
path = "{table}"
"""


def _trigger(port: int) -> str:
    return webhook_trigger("big", "new:amount::double > 100", f"http://127.0.0.1:{port}/hook")


def _events(daemon: DaemonProcess, name: str) -> list[dict[str, Any]]:
    out = []
    for line in daemon.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == name:
                out.append(record)
    return out


def _reload(daemon: DaemonProcess, config: Path, text: str, done_before: int) -> dict[str, Any]:
    config.write_text(text)
    daemon.signal(signal.SIGHUP)
    _wait_for(lambda: len(_events(daemon, "reload.done")) > done_before, 60, "reload.done", daemon)
    return _events(daemon, "reload.done")[-1]


def _order(key: str, amount: int) -> dict[str, Any]:
    return {"collection": "orders", "op": "insert", "key": key, "new": {"amount": amount},
            "old": None}  # fmt: skip


@pytest.mark.spark
def test_sighup_adds_the_first_trigger_and_removes_it_again(tmp_path: Path) -> None:
    """
    1. A daemon with a CDC stream and no triggers; Spark ready; one batch.
    2. SIGHUP with one webhook trigger: reload.done says it was added; a
       matching order reaches the receiver, a small one does not.
    3. SIGHUP without it: reload.done says it was removed; after the next
       orders committed, the receiver got nothing more.
    """
    receiver = Receiver()
    base = write_config(tmp_path, cores=2, extra=_stream(tmp_path / "cdc")).read_text()
    config = tmp_path / "config.toml"
    daemon = DaemonProcess.production(config).start(timeout_s=120)
    try:
        # Step 1
        _wait_spark_ready(daemon, timeout_s=180)
        post_events(daemon.ingest_url, [_order("before", 500)])
        _wait_caught_up(daemon, timeout_s=120)

        # Step 2
        done = _reload(daemon, config, base + _trigger(receiver.port), 0)
        assert done["triggers_added"] == ["big"], done
        assert done["triggers_removed"] == [] and "restart_needed" not in done
        ack = post_events(daemon.ingest_url, [_order("small", 5), _order("large", 5000)])
        _wait_for(lambda: receiver.rows(), 120, "the webhook call", daemon)
        _wait_caught_up(daemon, timeout_s=60)
        assert [r["idempotency_key"] for r in receiver.rows()] == [f"big:{ack['last_lsn']}"]
        assert daemon.status()["healthy"] is True

        # Step 3
        done = _reload(daemon, config, base, 1)
        assert done["triggers_removed"] == ["big"] and done["triggers_added"] == [], done
        calls = len(receiver.bodies)
        post_events(daemon.ingest_url, [_order("after", 9000)])
        time.sleep(0.5)  # a batch interval: the order is planned after the reload
        _wait_caught_up(daemon, timeout_s=60)
        assert len(receiver.bodies) == calls
    finally:
        rc = daemon.stop()
        receiver.close()
    assert rc == 0, daemon.tail()


def test_sighup_adding_triggers_without_spark_says_a_restart_is_needed(tmp_path: Path) -> None:
    """No streams, handlers or triggers at start: the daemon runs no Spark, so
    a reload that adds a trigger logs why a restart is needed, applies the rest
    (the log level) and does not claim the trigger."""
    config = write_config(tmp_path, cores=2)
    base = config.read_text()
    daemon = DaemonProcess.production(config).start(timeout_s=60)
    try:
        done = _reload(
            daemon, config, base.replace('level = "info"', 'level = "debug"') + _trigger(1), 0
        )
        (need,) = _events(daemon, "reload.triggers_need_restart")
        assert need["level"] == "error" and need["triggers"] == ["big"]
        assert "restart" in need["message"] and "Spark" in need["message"]
        assert done["triggers_not_applied"] == ["big"] and done["restart_needed"] is True
        assert done["triggers_added"] == [] and done["log_level"] == "debug"
        assert "triggers" not in daemon.status()
    finally:
        rc = daemon.stop()
    assert rc == 0, daemon.tail()
