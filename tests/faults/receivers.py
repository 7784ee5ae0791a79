"""Webhook receivers on loopback that misbehave on purpose."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.conftest import free_port


class Receiver:
    """Answers every POST with ``status`` after ``delay_s``; records 2xx bodies' rows."""

    def __init__(self, status: int = 200, delay_s: float = 0.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.status = status
        self.delay_s = delay_s
        self.calls = 0
        self.rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver._lock:
                    receiver.calls += 1
                    status, delay = receiver.status, receiver.delay_s
                if delay:
                    time.sleep(delay)
                if 200 <= status < 300:
                    with receiver._lock:
                        receiver.rows.extend(json.loads(body)["rows"])
                try:
                    self.send_response(status)
                    self.end_headers()
                except OSError:  # the daemon gave up waiting and closed
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def lsns(self) -> set[int]:
        with self._lock:
            return {int(r["lsn"]) for r in self.rows}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
