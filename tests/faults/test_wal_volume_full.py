"""A full WAL volume: ingest answers 507, health says so, nothing acknowledged
is lost, and the daemon resumes by itself when space returns (invariants 1, 14).

Scenario (a real daemon on a real 24 MiB tmpfs, real HTTP):
1. The daemon's data_dir is on the tmpfs (no Spark: the WAL is what is tested;
   retention off so every acknowledged record stays to be checked).
2. A filler file takes all but ~3 MiB; producers post until ingest answers
   507 with Retry-After and a message naming the WAL volume.
3. /healthz answers 503 naming the WAL; `/v1/status` lists the problem.
4. The filler goes: health clears without a request, the next posts succeed.
5. After a clean stop, the WAL holds every acknowledged event exactly once,
   and none of the refused ones.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.faults.support import healthz, tmpfs, wait_for
from tests.integration.harness import DaemonProcess, make_events, write_config
from wal import Wal

pytestmark = pytest.mark.crash


def _post(url: str, events: list[dict[str, Any]]) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = b"\n".join(json.dumps(e).encode() for e in events) + b"\n"
    req = urllib.request.Request(
        url + "/v1/events", data=body, method="POST",
        headers={"Content-Type": "application/x-ndjson"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as exc:
        doc = json.loads(exc.read())
        headers = dict(exc.headers)
        exc.close()
        return exc.code, doc, headers


@pytest.mark.timeout(300)
def test_full_wal_volume_answers_507_loses_nothing_and_resumes_when_space_returns(
    tmp_path: Path,
) -> None:
    with tmpfs(tmp_path / "vol", size="24m") as vol:
        config = write_config(tmp_path, cores=2, wal='retention = "keep"')
        text = config.read_text().replace('data_dir = "data"', f'data_dir = "{vol / "data"}"')
        config.write_text(text)
        daemon = DaemonProcess.production(config).start(timeout_s=60)
        acked: dict[int, int] = {}  # lsn -> event number
        refused: list[tuple[int, dict[str, Any], dict[str, str]]] = []
        try:
            # Step 2. Fill the volume, then post until the WAL runs out of room.
            filler = vol / "filler"
            _take(filler, _free_bytes(vol) - 3 * 1024 * 1024)
            n = 0
            while len(refused) < 3 and n < 200_000:
                events = make_events(n, 200)
                code, doc, headers = _post(daemon.ingest_url, events)
                if code == 200:
                    for i, lsn in enumerate(range(doc["first_lsn"], doc["last_lsn"] + 1)):
                        acked[lsn] = n + i
                else:
                    refused.append((code, doc, headers))
                n += 200
            assert refused, "the volume never filled up"
            codes = {c for c, _, _ in refused}
            assert codes == {507}, refused[0]
            _, doc, headers = refused[0]
            assert doc["error"] == "wal_full" and "full" in doc["message"]
            assert "nothing from this request was acknowledged" in doc["message"]
            assert headers.get("Retry-After") == "1"
            # Step 3. Health says what is wrong.
            code, health = healthz(daemon)
            assert code == 503 and [p["part"] for p in health["problems"]] == ["wal"]
            status = daemon.status()
            assert status["healthy"] is False and not status["needs_restart"]
            # Step 4. Space returns: health clears by itself, posts succeed again.
            filler.unlink()
            wait_for("healthz clears", lambda: healthz(daemon)[0] == 200, 30, daemon)
            code, doc, _ = _post(daemon.ingest_url, make_events(n, 200))
            assert code == 200, doc
            for i, lsn in enumerate(range(doc["first_lsn"], doc["last_lsn"] + 1)):
                acked[lsn] = n + i
        finally:
            code = daemon.stop()
        assert code == 0, daemon.tail()

        # Step 5. Every acknowledged event exactly once, in LSN order, nothing else.
        with Wal.open(vol / "data" / "wal") as wal:
            lsns = [r.lsn for r in wal.read(1)]
        assert lsns == sorted(acked), "the WAL does not hold exactly the acknowledged events"


def _free_bytes(path: Path) -> int:
    import os

    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _take(filler: Path, nbytes: int) -> None:
    """Write ``nbytes`` of zeros into ``filler`` (tmpfs counts written pages)."""
    chunk = b"\0" * (1 << 20)
    with filler.open("wb") as f:
        left = nbytes
        while left > 0:
            f.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
