"""With ``log.format = "json"`` every line the daemon process writes is one JSON
object: its own events, stdlib records, warnings, uncaught exceptions and the
Spark JVM's log (docs/operating.md, "Logs")."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import (
    ROOT,
    DaemonProcess,
    post_events,
    webhook_trigger,
    write_config,
)
from tests.integration.noisy_handler import MARK
from tests.integration.test_cdc_crash import _wait_spark_ready
from tests.integration.test_triggers_daemon import Receiver, _wait_for

# Every line is JSON: even what the JVM prints before its logging exists
# ("WARNING: Using incubator modules") reaches us through a pipe and is logged
# as a ``spark.jvm_output`` event (daemon/spark/session.py).
KEYS = {"timestamp", "level", "event"}


def _records(text: str) -> list[dict[str, Any]]:
    """Every line as a JSON object; fails on any line that is not one."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"line {n} is not JSON: {line[:300]!r}")
        assert isinstance(record, dict), f"line {n} is not an object: {line[:300]!r}"
        assert record.keys() >= KEYS, f"line {n} lacks {KEYS - record.keys()}: {line[:300]!r}"
        out.append(record)
    return out


def _extra(receiver_port: int, table: Path) -> str:
    return f"""
[spark]
master = "local[1]"
log_level = "WARN"

[[cdc.streams]]
name = "all"
collections = "*"
path = "{table}"

[[cdc.handlers]]
function = "tests.integration.noisy_handler:noisy"
""" + webhook_trigger("big", "new:amount::double > 100", f"http://127.0.0.1:{receiver_port}/hook")


@pytest.mark.spark
def test_every_line_of_a_spark_daemon_is_one_json_object(tmp_path: Path) -> None:
    """
    1. A daemon with a CDC stream, a handler and a webhook trigger, JSON logs.
    2. One batch: the trigger fires; the handler warns, logs through the JVM
       with a Java exception, logs through stdlib, and lets a thread die.
    3. SIGTERM: exit 0. Every line of stdout+stderr is a JSON object with
       timestamp, level and event, and each kind of output is there once.
    """
    receiver = Receiver()
    config = write_config(tmp_path, cores=2, extra=_extra(receiver.port, tmp_path / "cdc"))
    daemon = DaemonProcess.production(config).start(timeout_s=120)
    try:
        # Steps 1-2
        _wait_spark_ready(daemon, timeout_s=180)
        post_events(
            daemon.ingest_url,
            [{"collection": "orders", "op": "insert", "key": "o1", "new": {"amount": 500},
              "old": None}],
        )  # fmt: skip
        _wait_for(lambda: receiver.rows(), 120, "the webhook call", daemon)
        _wait_for(
            lambda: "uncaught in a thread" in daemon.log_path.read_text(errors="replace"),
            60,
            "the handler's output",
            daemon,
        )
    finally:
        # Step 3
        rc = daemon.stop()
        receiver.close()
    assert rc == 0, daemon.tail()
    records = _records(daemon.log_path.read_text(errors="replace"))
    noise = [r for r in records if MARK in json.dumps(r)]

    (warning,) = [r for r in noise if r["event"] == "process.warning"]
    assert warning["level"] == "warning" and warning["category"] == "UserWarning"
    (jvm,) = [r for r in noise if r.get("logger") == "eventplane.test.jvm"]
    assert jvm["level"] == "warning"
    assert jvm["exception"].startswith("java.lang.IllegalStateException: ")
    assert "\n\tat " in jvm["exception"]  # the stack trace, as one field
    (stdlib,) = [r for r in noise if r.get("logger") == "pyspark.test"]
    assert stdlib["level"] == "warning"
    (thread,) = [r for r in noise if r["event"] == "process.thread_exception"]
    assert thread["thread"] == "noisy-thread"
    assert thread["exception"].startswith("Traceback (most recent call last)")
    events = [r["event"] for r in records]
    assert "spark_session_ready" in events and "shutdown.done" in events
    # What the JVM printed before its logging existed arrives as an event too.
    jvm_text = [r["line"] for r in records if r["event"] == "spark.jvm_output"]
    assert any("incubator modules" in line for line in jvm_text), jvm_text


def _run(config: Path, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``eventplane run`` to its end (a start-up failure), stderr into stdout unless asked."""
    kw.setdefault("stderr", subprocess.STDOUT)
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli.main", "run", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        timeout=60,
        **kw,
    )


def test_a_port_in_use_is_one_json_line_with_the_real_exit_code(tmp_path: Path) -> None:
    """
    1. Something else holds the ingest port.
    2. The daemon exits non-zero; its whole output is JSON, with exactly one
       ``startup.failed`` naming the listener, the address and what to do,
       whose exit_code (and shutdown.done's) is the process's exit code.
    """
    config = write_config(tmp_path)
    listen = next(
        line.split('"')[1] for line in config.read_text().splitlines() if "listen" in line
    )  # the [ingest] one comes first
    host, port = listen.split(":")
    with socket.socket() as holder:
        holder.bind((host, int(port)))
        holder.listen()
        proc = _run(config)
    assert proc.returncode == 1, proc.stdout
    records = _records(proc.stdout)
    (failed,) = [r for r in records if r["event"] == "startup.failed"]
    assert failed["exit_code"] == proc.returncode
    assert f"[ingest] listen = {listen}" in failed["step"]
    assert "address already in use" in failed["error"]
    assert "another process listens" in failed["hint"]
    assert "exception" not in failed  # an expected failure: no traceback
    (done,) = [r for r in records if r["event"] == "shutdown.done"]
    assert done["exit_code"] == proc.returncode


def test_an_invalid_config_is_one_json_line_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[daemon]\ncores = 0\n[log]\nformat = "json"\n')
    proc = _run(config, stderr=subprocess.PIPE)
    assert proc.returncode == 2
    assert proc.stdout.strip() and not proc.stderr.strip()
    (failed,) = _records(proc.stdout)
    assert failed["event"] == "startup.failed" and failed["exit_code"] == 2
    assert "daemon.cores: expected an integer >= 1" in failed["error"]
    assert "check-config" in failed["hint"]


def test_an_unwritable_data_dir_is_one_json_line_with_exit_1(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    blocker = tmp_path / "data"
    blocker.write_text("a file where the data dir should be")
    proc = _run(config)
    assert proc.returncode == 1, proc.stdout
    records = _records(proc.stdout)
    (failed,) = [r for r in records if r["event"] == "startup.failed"]
    assert str(blocker) in failed["step"] and failed["exit_code"] == 1
    assert [r["exit_code"] for r in records if r["event"] == "shutdown.done"] == [1]
