"""Triggers through the whole daemon: HTTP in, Spark `when`, webhook out, SIGHUP."""

from __future__ import annotations

import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from tests.integration.harness import DaemonProcess, post_events, write_config
from tests.integration.test_cdc_crash import _wait_spark_ready


class Receiver:
    """A real HTTP receiver on loopback that records every webhook body."""

    def __init__(self) -> None:
        self.port = free_port()
        self.bodies: list[dict[str, Any]] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def rows(self) -> list[dict[str, Any]]:
        return [row for body in list(self.bodies) for row in body["rows"]]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _trigger(port: int, when: str) -> str:
    return f"""
[spark]
master = "local[2]"
log_level = "ERROR"

[[triggers]]
name = "large-orders"
collection = "orders"
on = ["insert", "update"]
when = "{when}"
action = {{ type = "webhook", url = "http://127.0.0.1:{port}/hook" }}
"""


def _wait_for(predicate: Any, timeout_s: float, what: str, daemon: DaemonProcess) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}\n{daemon.tail()}")


@pytest.mark.spark
def test_daemon_delivers_matching_rows_to_a_webhook_and_sighup_keeps_a_valid_set(
    tmp_path: Path,
) -> None:
    """
    1. A daemon with one webhook trigger (`new:amount::double > 1000`) gets
       orders over HTTP: only the large inserts/updates reach the receiver,
       each with its `<trigger>:<lsn>` idempotency key.
    2. SIGHUP with a broken `when` is rejected; the old trigger keeps firing.
    """
    receiver = Receiver()
    config = write_config(tmp_path, extra=_trigger(receiver.port, "new:amount::double > 1000"))
    daemon = DaemonProcess.production(config).start(timeout_s=120)
    try:
        _wait_spark_ready(daemon)
        events = [
            {"collection": "orders", "op": "insert", "key": "a", "new": {"amount": 5000}},
            {"collection": "orders", "op": "insert", "key": "b", "new": {"amount": 10}},
            {"collection": "users", "op": "insert", "key": "c", "new": {"amount": 9000}},
            {"collection": "orders", "op": "delete", "key": "a", "old": {"amount": 5000}},
            {
                "collection": "orders",
                "op": "update",
                "key": "b",
                "new": {"amount": 1001},
                "old": {"amount": 10},
            },
        ]
        for e in events:
            e.setdefault("new", None)
            e.setdefault("old", None)
        ack = post_events(daemon.ingest_url, events)
        first = ack["first_lsn"]
        # Step 1. Exactly the two matching rows, with their idempotency keys.
        _wait_for(lambda: len(receiver.rows()) >= 2, 90, "two webhook rows", daemon)
        rows = receiver.rows()
        assert sorted(r["idempotency_key"] for r in rows) == [
            f"large-orders:{first}",
            f"large-orders:{first + 4}",
        ]

        # Step 2. A broken trigger set is rejected; the old one still fires.
        config.write_text(
            config.read_text().replace("new:amount::double > 1000", "new:amount::double >>> oops")
        )
        daemon.signal(signal.SIGHUP)
        _wait_for(
            lambda: "reload.triggers_rejected" in daemon.log_path.read_text(),
            60,
            "the reload to be rejected",
            daemon,
        )
        ack = post_events(
            daemon.ingest_url,
            [
                {
                    "collection": "orders",
                    "op": "insert",
                    "key": "z",
                    "new": {"amount": 7777},
                    "old": None,
                }
            ],
        )
        _wait_for(
            lambda: (
                f"large-orders:{ack['first_lsn']}"
                in {r["idempotency_key"] for r in receiver.rows()}
            ),
            60,
            "the old trigger to fire after the rejected reload",
            daemon,
        )
        assert daemon.status()["healthy"] is True
    finally:
        rc = daemon.stop()
        receiver.close()
    assert rc == 0, daemon.tail()
