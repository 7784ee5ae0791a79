"""Producers through a real daemon's SIGTERM drain (docs/ingest.md, "Draining").

The production daemon runs without Spark here (no CDC stream, handler or
trigger: its executor is the null one), so these tests are about ingest only.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

from daemon.events import decode
from tests.integration.harness import ROOT, DaemonProcess, make_events, write_config
from wal import Wal

EVENTPLANE = ROOT / ".venv" / "bin" / "eventplane"


def wal_payload_ids(data_dir: Path) -> list[int]:
    """The ``new.i`` of every event in the (stopped) daemon's WAL, in LSN order."""

    async def read() -> list[int]:
        wal = await asyncio.to_thread(Wal.open, data_dir / "wal", segment_bytes=1 << 20)
        try:
            ids = []
            for record in wal.read(1):
                new = decode(record.payload).new
                assert new is not None
                ids.append(int(json.loads(new)["i"]))
            return ids
        finally:
            await wal.aclose()

    return asyncio.run(read())


def produce_raw(
    url: str, pid: int, outcomes: list[str], acked: list[int], go: threading.Event
) -> None:
    """Post 200-event requests back to back on one kept-alive connection, as a plain
    HTTP client would (no retries), until an answer other than 200 or an error."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    i = pid * 10_000_000
    go.wait()
    try:
        while True:
            body = "".join(json.dumps(e) + "\n" for e in make_events(i, 200)).encode()
            try:
                conn.request("POST", "/v1/events", body, {"Content-Type": "application/x-ndjson"})
                resp = conn.getresponse()
                doc = json.loads(resp.read() or b"{}")
            except ConnectionRefusedError:
                outcomes.append("refused")
                return
            except (OSError, http.client.HTTPException) as exc:
                outcomes.append(f"dropped: {type(exc).__name__}: {exc}")
                return
            if resp.status == 200:
                acked.append(doc["accepted"])
                i += 200
                continue
            close = resp.getheader("Connection", "")
            outcomes.append(
                f"{resp.status} {doc.get('error')} retry-after={resp.getheader('Retry-After')} "
                f"connection={close}"
            )
            return
    finally:
        conn.close()


def test_producers_posting_through_sigterm_get_200_or_503_draining_never_a_reset(
    tmp_path: Path,
) -> None:
    """
    1. Four producers post back to back, each on one kept-alive connection.
    2. SIGTERM mid-load: the daemon drains and exits 0.
    3. Every request got an answer: 200, or 503 draining with Retry-After and
       Connection: close (then the producer stops, as it would wait). None saw
       a reset or a connection closed under its request (before this fix, most
       did: BrokenPipe, RemoteDisconnected).
    4. The WAL holds exactly the acknowledged events.
    """
    config = write_config(tmp_path, wal='retention = "keep"')
    daemon = DaemonProcess.production(config).start()
    outcomes: list[str] = []
    acked: list[int] = []
    go = threading.Event()
    producers = [
        threading.Thread(target=produce_raw, args=(daemon.ingest_url, p, outcomes, acked, go))
        for p in range(4)
    ]
    for t in producers:
        t.start()
    go.set()
    time.sleep(1.0)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(timeout_s=30) == 0, daemon.tail()
    for t in producers:
        t.join(timeout=30)
    assert acked, "no request was acknowledged before the signal"
    assert outcomes == ["503 draining retry-after=1 connection=close"] * 4, outcomes
    assert len(wal_payload_ids(tmp_path / "data")) == sum(acked)


def test_send_through_a_sigterm_and_a_restart_stores_every_line_once_in_input_order(
    tmp_path: Path,
) -> None:
    """
    1. `eventplane send` posts 200,000 lines in requests of 500.
    2. SIGTERM mid-way: send gets 503 draining, then refused connections, and keeps
       retrying (same Idempotency-Key per request).
    3. The daemon starts again on the same data and port: send finishes, exit 0.
    4. The WAL holds every line exactly once, in stdin order (LSNs follow input
       order across the restart).
    """
    config = write_config(tmp_path, wal='retention = "keep"')
    daemon = DaemonProcess.production(config).start()
    lines = 200_000
    data = tmp_path / "in.ndjson"
    with data.open("w") as f:
        for start in range(0, lines, 5_000):
            f.writelines(json.dumps(e) + "\n" for e in make_events(start, 5_000))
    with data.open("rb") as stdin:
        send = subprocess.Popen(
            [str(EVENTPLANE), "send", "--url", daemon.ingest_url, "--batch", "500"],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
        )
    try:
        # SIGTERM once a few requests are in, not after a fixed sleep: on a quiet
        # machine send can take all the lines in well under a second.
        deadline = time.monotonic() + 30
        while daemon.status()["wal"]["head_lsn"] < 2_000:
            assert send.poll() is None, "send finished before the signal: give it more lines"
            assert time.monotonic() < deadline, "send stored nothing within 30 s"
            time.sleep(0.005)
        assert send.poll() is None, "send finished before the signal: give it more lines"
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(timeout_s=30) == 0, daemon.tail()
        time.sleep(1.5)  # send retries against a stopped daemon meanwhile
        assert send.poll() is None
        daemon = DaemonProcess.production(config).start()
        out, err = send.communicate(timeout=120)
    finally:
        if send.poll() is None:
            send.kill()
    assert send.returncode == 0, err.decode()
    summary = out.decode()
    assert summary.startswith(f"sent {lines} events in {lines // 500} requests ("), summary
    assert "retried" in summary
    assert b"HTTP 503 draining" in err or b"cannot connect" in err
    assert daemon.stop() == 0
    assert wal_payload_ids(tmp_path / "data") == list(range(lines))
