"""bench_shared's parts (the benchmark itself: `python -m bench.bench_shared`):
the daemon configs it writes load, and the proxy it counts S3 requests with
(bench_s3's) counts what goes through."""

from __future__ import annotations

import http.server
import threading
import urllib.request
from pathlib import Path

import pytest

from bench.bench_s3 import CountingProxy
from bench.bench_shared import Daemon, table_setting
from daemon import config

S3 = (
    '[s3]\nendpoint = "http://127.0.0.1:9"\npath_style = true\n'
    'access_key_id = "k"\nsecret_access_key = "s"\n'
)


@pytest.mark.parametrize(
    ("where", "s3"), [("{root}/table", ""), ("s3://lake/t", S3)], ids=["disk", "s3"]
)
def test_each_daemon_config_the_bench_writes_loads_with_its_name_and_a_shared_stream(
    tmp_path: Path, where: str, s3: str
) -> None:
    uri = where.format(root=tmp_path)
    daemon = Daemon(tmp_path, 2, table_setting(uri), s3)
    loaded = config.load(daemon.dir / "config.toml")
    (stream,) = loaded.cdc.streams
    assert loaded.daemon.name == "ep-2"
    assert (stream.writers, stream.location) == ("shared", uri)


def test_the_proxy_counts_each_http_request_and_passes_the_answers_back() -> None:
    class Answer(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proxy = CountingProxy(f"http://127.0.0.1:{server.server_address[1]}")
        proxy.start()
        for _ in range(3):
            with urllib.request.urlopen(f"{proxy.endpoint}/x", timeout=5) as r:
                assert r.read() == b"ok"
        assert len(proxy.requests) == 3
    finally:
        server.shutdown()
