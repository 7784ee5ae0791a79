"""The WAL archive with real daemons against a real SeaweedFS (tests/s3/server.py):

1. ``ack = "archived"``, SIGKILL during uploads: every acknowledged event is
   in the archive, whose objects hold exactly the WAL's frames (checksums
   verified); the restarted daemon takes the archive back at once and
   archives the rest.
2. An outage in ``archived`` mode: ingest answers 503 + Retry-After, nothing
   unarchived is acknowledged or reaches a stage, health names the archive,
   and it all resumes by itself when the store returns.
3. The fence: the holder is SIGSTOPped past its lease, a second holder takes
   the manifest and writes its fences, SIGCONT: the old holder's next upload
   fails, it acknowledges nothing more and health says why.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from daemon.config import WalArchiveConfig
from daemon.metrics import Metrics
from daemon.walarchive import WalArchive
from tests.faults.support import healthz, wait_for
from tests.integration.harness import DaemonProcess, Loader, make_events, write_config
from tests.s3.server import S3Server, Weed, start_weed
from wal import Wal
from wal.archive import parse_object

# Each test's CI budget is 90 s on a quiet machine (CONTRIBUTING.md, "Tests");
# the guard allows for the suite's parallel workers (the disaster test took 90 s there).
pytestmark = [pytest.mark.crash, pytest.mark.timeout(300)]
TTL_S, SKEW_S = 4.0, 1.0


def _s3(server: S3Server) -> str:
    return f"""
[s3]
endpoint = "{server.endpoint}"
path_style = true
access_key_id = "{server.access_key}"
secret_access_key = "{server.secret_key}"
connect_timeout_s = 1
request_timeout_s = 1
max_retries = 0
lease_ttl_s = {TTL_S}
lease_skew_s = {SKEW_S}
"""


def _daemon(tmp_path: Path, weed: Weed, prefix: str, ack: str = "archived") -> DaemonProcess:
    server = weed.server
    extra = f"""{_s3(server)}
[wal.archive]
uri = "s3://{server.bucket}/{prefix}"
ack = "{ack}"
flush_ms = 50

[health]
stall_after_s = 2
"""
    # retention = "keep": the archive keeps every object too, so its content from LSN 1
    # can be compared with the WAL's (test_wal_archive.py in tests/s3 covers retention).
    config = write_config(tmp_path, extra, ingest="retry_after_s = 1", wal='retention = "keep"')
    return DaemonProcess.production(config)


def _post(url: str, n: int = 10, start: int = 0) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = b"\n".join(json.dumps(e).encode() for e in make_events(start, n)) + b"\n"
    req = urllib.request.Request(
        url + "/v1/events",
        data=body,
        method="POST",
        headers={"Content-Type": "application/x-ndjson"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        headers = dict(exc.headers)
        exc.close()
        return exc.code, json.loads(raw), headers


def _archive_contents(server: S3Server, prefix: str) -> dict[int, bytes]:
    """First LSN -> frame bytes of every object that counts (module
    daemon/walarchive.py: fences mask older epochs after them), every CRC checked."""
    s3 = server.client()
    pages = s3.get_paginator("list_objects_v2").paginate(
        Bucket=server.bucket, Prefix=f"{prefix}/wal/"
    )
    keys = sorted(o["Key"] for p in pages for o in p.get("Contents", []))
    frames: dict[int, bytes] = {}
    masked = 0
    for key in keys:
        head, got = parse_object(s3.get_object(Bucket=server.bucket, Key=key)["Body"].read())
        if head.fence:
            masked = max(masked, head.epoch)
            continue
        if head.epoch < masked:
            continue
        for first, _events, raw in got:
            frames[first] = raw
    return frames


def _covered(frames: dict[int, bytes]) -> int:
    """The archive's contiguous end from LSN 1 (0: nothing)."""
    from wal.format import FRAME_HEADER

    lsn = 1
    while lsn in frames:
        lsn += FRAME_HEADER.unpack_from(frames[lsn], 0)[7]
    return lsn - 1


def test_sigkill_during_uploads_loses_nothing_acknowledged(tmp_path: Path) -> None:
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    daemon = _daemon(tmp_path, weed, "kill")
    loader = Loader("", batch=50, producers=4)
    try:
        daemon.start(timeout_s=60)
        status, body, _ = _post(daemon.ingest_url)
        assert status == 200 and body["ack"] == "archived", body
        loader.url = daemon.ingest_url
        loader.start()
        wait_for("acks flow", lambda: len(loader.acked) > 40, 30, daemon)
        daemon.kill()  # uploads under way
        loader.stop()
        acked = loader.acked_lsns() | set(range(body["first_lsn"], body["last_lsn"] + 1))
        frames = _archive_contents(weed.server, "kill")
        covered = _covered(frames)
        assert max(acked) <= covered, (max(acked), covered)
        # The archive's frames are the WAL's, byte for byte.
        wal = Wal.open(tmp_path / "data" / "wal")
        try:
            local = {f[0]: f[2] for f in wal.read_frames(1)}
            head = wal.head_lsn()
        finally:
            wal.close()
        assert all(local[first] == raw for first, raw in frames.items())
        # The same daemon restarted takes the archive back at once and ships the rest.
        daemon.start(timeout_s=60)
        wait_for(
            "the rest archived",
            lambda: daemon.status()["wal"]["archive"]["archived_lsn"] >= head,
            30,
            daemon,
        )
        assert daemon.status()["wal"]["archive"]["epoch"] == 2
        assert daemon.stop() == 0
        assert _covered(_archive_contents(weed.server, "kill")) >= head
    finally:
        loader.stop()
        daemon.stop()
        weed.stop()


def test_an_outage_in_archived_mode_acks_nothing_unarchived_and_resumes(tmp_path: Path) -> None:
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    daemon = _daemon(tmp_path, weed, "outage")
    loader = Loader("", batch=50, producers=2, pause_s=0.05)
    timeline: list[tuple[str, float]] = []
    try:
        daemon.start(timeout_s=60)
        loader.url = daemon.ingest_url
        loader.start()
        wait_for("acks flow", lambda: len(loader.acked) > 20, 30, daemon)
        down = time.monotonic()
        weed.stop()
        timeline.append(("store stopped", time.monotonic() - down))
        answer = wait_for(
            "503 + Retry-After",
            lambda: (lambda r: r if r[0] == 503 else None)(_post(daemon.ingest_url)),
            30,
            daemon,
        )
        timeline.append(("503", time.monotonic() - down))
        _, body, headers = answer
        # The outage, or (past lease_ttl_s - lease_skew_s) the manifest not renewed.
        assert body["error"] in ("archive_unavailable", "not_primary"), body
        assert headers.get("Retry-After") == "1", headers
        _, health = wait_for(
            "health names the archive",
            lambda: (lambda h: h if h[0] == 503 else None)(healthz(daemon)),
            30,
            daemon,
        )
        timeline.append(("health 503", time.monotonic() - down))
        assert any(p["part"] == "wal archive" for p in health["problems"]), health
        st = daemon.status()
        archived = st["wal"]["archive"]["archived_lsn"]
        assert st["wal"]["archive"]["outage"], st["wal"]["archive"]
        # Nothing unarchived is acknowledged, or delivered to a stage.
        assert max(loader.acked_lsns()) <= archived
        assert all(c["watermark"] <= archived for c in st["cores"]), st["cores"]
        time.sleep(max(0.0, 6.0 - (time.monotonic() - down)))  # past the lease's ttl too
        assert max(loader.acked_lsns()) <= daemon.status()["wal"]["archive"]["archived_lsn"]
        weed.start()
        timeline.append(("store back", time.monotonic() - down))
        acked_before = len(loader.acked)
        wait_for("acks again", lambda: len(loader.acked) > acked_before + 10, 30, daemon)
        timeline.append(("acks again", time.monotonic() - down))
        wait_for("health clears", lambda: healthz(daemon)[0] == 200, 30, daemon)
        timeline.append(("health 200", time.monotonic() - down))
        loader.stop()
        assert daemon.stop() == 0
        covered = _covered(_archive_contents(weed.server, "outage"))
        assert max(loader.acked_lsns()) <= covered
    finally:
        loader.stop()
        daemon.stop()
        weed.stop()
    print("outage timeline (s after the store stopped):", timeline)


def test_a_paused_holder_is_fenced_at_its_next_upload(tmp_path: Path) -> None:
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    daemon = _daemon(tmp_path, weed, "fence")
    loader = Loader("", batch=20, producers=2, pause_s=0.05)
    timeline: list[tuple[str, float]] = []
    try:
        daemon.start(timeout_s=60)
        loader.url = daemon.ingest_url
        loader.start()
        wait_for("acks flow", lambda: len(loader.acked) > 20, 30, daemon)
        daemon.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        acked_at_stop = loader.acked_lsns()
        time.sleep(TTL_S + SKEW_S + 0.5)  # past expires_at + skew
        # The second holder: the same WAL (a copy, same id) on another data_dir.
        shutil.copytree(
            tmp_path / "data" / "wal",
            tmp_path / "b" / "wal",
            ignore=lambda _d, names: [n for n in names if n == "LOCK"],
        )
        new = asyncio.run(_take_over(server, tmp_path / "b"))
        timeline.append(("takeover: manifest and fences", time.monotonic() - t0))
        daemon.signal(signal.SIGCONT)
        timeline.append(("SIGCONT", time.monotonic() - t0))
        st = wait_for(
            "the old holder is fenced",
            lambda: (lambda a: a if a["fenced"] else None)(daemon.status()["wal"]["archive"]),
            30,
            daemon,
        )
        timeline.append(("old holder's upload failed: fenced", time.monotonic() - t0))
        # Its next upload met a fence, or its next renewal found the manifest taken.
        assert "create of archive object" in st["fenced"] or "taken over" in st["fenced"], st
        assert f"epoch {new['epoch']}" in st["fenced"], st
        code, health = healthz(daemon)
        timeline.append(("health 503", time.monotonic() - t0))
        assert code == 503 and any("fenced" in p["message"] for p in health["problems"]), health
        status, body, _ = _post(daemon.ingest_url)
        assert status == 503 and "fenced" in json.dumps(body), body
        acked_after = len(loader.acked)
        time.sleep(1.0)
        assert len(loader.acked) == acked_after  # it acknowledges nothing more
        loader.stop()
        # Every acknowledged event is in what the new holder took over.
        acked = loader.acked_lsns()
        assert acked_at_stop <= acked and max(acked) <= new["archived_lsn"]
        assert max(acked) <= _covered(_archive_contents(server, "fence"))
    finally:
        loader.stop()
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.signal(signal.SIGCONT)
        daemon.stop()
        weed.stop()
    print("fence timeline (s after SIGSTOP):", timeline)


async def _take_over(server: S3Server, data_dir: Path) -> dict[str, int]:
    wal = Wal.open(data_dir / "wal")
    try:
        s3cfg = server.config(
            lease_ttl_s=TTL_S,
            lease_skew_s=SKEW_S,
            connect_timeout_s=1,
            request_timeout_s=1,
            max_retries=0,
        )
        archive = WalArchive(
            WalArchiveConfig(uri=f"s3://{server.bucket}/fence"),
            s3cfg,
            wal,
            str(data_dir),
            Metrics(cores=4),
        )
        await archive.open()
        out = {"epoch": archive.epoch, "archived_lsn": archive.archived_lsn}
        await archive.stop(1)
        return out
    finally:
        wal.close()


def test_local_mode_acks_through_an_outage_until_max_unarchived_bytes(tmp_path: Path) -> None:
    """``ack = "local"``: the store goes away, acks go on (``"ack": "local"``)
    and stages keep committing, while the manifest's lease lasts (29 s here, so
    a loaded machine fills the cap first: past ``lease_ttl_s - lease_skew_s`` a
    standby may take over and this daemon answers ``not_primary``), until
    ``max_unarchived_bytes``: then 503 +
    Retry-After; when the store returns everything acknowledged is archived
    (nothing was dropped) and ingest takes events again."""
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    daemon = _daemon(tmp_path, weed, "local", ack="local")
    text = (
        daemon.config.read_text()
        .replace("flush_ms = 50\n", "flush_ms = 50\nmax_unarchived_bytes = 1048576\n")
        .replace(f"lease_ttl_s = {TTL_S}\n", "lease_ttl_s = 30.0\n")
    )
    daemon.config.write_text(text)
    acked: set[int] = set()
    try:
        daemon.start(timeout_s=60)
        weed.stop()
        refused = None
        for i in range(200):
            status, body, headers = _post(daemon.ingest_url, n=500, start=i * 500)
            if status != 200:
                refused = (status, body, headers)
                break
            assert body["ack"] == "local", body
            acked |= set(range(body["first_lsn"], body["last_lsn"] + 1))
        assert refused is not None, "never refused"
        status, body, headers = refused
        assert status == 503 and body["error"] == "archive_unavailable", body
        assert "max_unarchived_bytes" in body["message"] and headers.get("Retry-After") == "1"
        st = daemon.status()
        assert st["wal"]["archive"]["unarchived_bytes"] > 1 << 20
        # Stages do not wait for the archive in this mode.
        wait_for(
            "stages commit unarchived events",
            lambda: (
                min(c["watermark"] for c in daemon.status()["cores"])
                > daemon.status()["wal"]["archive"]["archived_lsn"]
            ),
            30,
            daemon,
        )
        weed.start()
        wait_for(
            "everything archived",
            lambda: daemon.status()["wal"]["archive"]["archived_lsn"] >= max(acked),
            30,
            daemon,
        )
        assert _post(daemon.ingest_url)[0] == 200
        assert daemon.stop() == 0
        assert _covered(_archive_contents(weed.server, "local")) >= max(acked)
    finally:
        daemon.stop()
        weed.stop()


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_soak_sigkill_loop_in_archived_mode(tmp_path: Path) -> None:
    """Twenty SIGKILLs at random moments of uploads, a restart after each:
    every acknowledged event is in the archive each time (``--soak``)."""
    rng = random.Random(41)
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    daemon = _daemon(tmp_path, weed, "soak")
    acked: set[int] = set()
    try:
        for _round in range(20):
            daemon.start(timeout_s=60)
            loader = Loader(daemon.ingest_url, batch=50, producers=4)
            loader.start()
            time.sleep(rng.uniform(0.5, 3.0))
            daemon.kill()
            loader.stop()
            acked |= loader.acked_lsns()
            if acked:
                assert max(acked) <= _covered(_archive_contents(weed.server, "soak"))
    finally:
        daemon.stop()
        weed.stop()
