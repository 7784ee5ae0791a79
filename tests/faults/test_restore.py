"""``eventplane restore`` (daemon/restore.py) with real daemons against a real
SeaweedFS (tests/s3/server.py): a lost disk in ``ack = "archived"``.

1. The disaster (real Spark, a Delta stream on S3): producers, SIGKILL, the
   whole data_dir deleted; ``run`` refuses naming ``eventplane restore``; the
   restore rebuilds it (same WAL id, every checksum); the daemon runs again:
   every acknowledged event exactly once in the table, batch ids above the
   table's.
2. A bit flip in an archive object, then an object deleted by hand: refused,
   naming the object, nothing changed; ``--accept-loss-from`` names the LSNs
   lost and the daemon archives on above them.
3. A SIGKILL during a restore (each crash point): no WAL in place, ``run``
   still refuses; a second restore succeeds with the archive's frames.
4. The disaster in ``ack = "local"`` with the archive's uploads hung
   (``EVENTPLANE_STALL_AT``) while the lake commits: what is lost is at most
   the unarchived window status reported before the kill, nothing is
   duplicated, and the WAL goes on above the lake's LSNs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from daemon.table.crash import ENV_CRASH_AT, ENV_STALL_AT, RESTORE_CRASH_POINTS
from tests import requires
from tests.faults.support import spark_config, stage, wait_for
from tests.faults.test_wal_archive import _archive_contents, _post, _s3
from tests.integration.harness import ROOT, DaemonProcess, Loader, make_events, write_config
from tests.s3.server import S3Server, Weed, start_weed
from wal import Wal
from wal.archive import OBJECT_HEADER_SIZE, object_name, parse_header
from wal.format import FRAME_HEADER

# Each test's CI budget is 90 s on a quiet machine (CONTRIBUTING.md, "Tests");
# the guard allows for the suite's parallel workers (the disaster test took 90 s there).
pytestmark = [pytest.mark.crash, pytest.mark.timeout(300)]


def _archive_toml(server: S3Server, prefix: str) -> str:
    return f"""{_s3(server)}
[wal.archive]
uri = "s3://{server.bucket}/{prefix}"
ack = "archived"
flush_ms = 50
"""


def _eventplane(config: Path, *argv: str, env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli.main", *argv, "--config", str(config)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _run_refuses(config: Path) -> str:
    got = _eventplane(config, "run")
    assert got.returncode != 0
    out = got.stdout + got.stderr
    assert "eventplane restore" in out, out
    return out


def _objects(server: S3Server, prefix: str) -> list[str]:
    s3 = server.client()
    pages = s3.get_paginator("list_objects_v2").paginate(
        Bucket=server.bucket, Prefix=f"{prefix}/wal/"
    )
    return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


def _data_objects(server: S3Server, prefix: str) -> list[tuple[str, Any]]:
    s3 = server.client()
    out = []
    for key in _objects(server, prefix):
        raw = s3.get_object(
            Bucket=server.bucket, Key=key, Range=f"bytes=0-{OBJECT_HEADER_SIZE - 1}"
        )
        head = parse_header(raw["Body"].read())
        if not head.fence:
            out.append((key, head))
    return out


def _wal_frames(wal_dir: Path) -> tuple[str, dict[int, bytes]]:
    wal = Wal.open(wal_dir)
    try:
        return wal.wal_id, {f[0]: f[2] for f in wal.read_frames(wal.retained_floor())}
    finally:
        wal.close()


def _post_keyed(url: str, key: str) -> dict[str, Any]:
    body = b"\n".join(json.dumps(e).encode() for e in make_events(0, 5)) + b"\n"
    req = urllib.request.Request(
        url + "/v1/events",
        data=body,
        method="POST",
        headers={"Content-Type": "application/x-ndjson", "Idempotency-Key": key},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return dict(json.loads(r.read()))


def _fill(daemon: DaemonProcess, posts: int) -> tuple[str, int]:
    """``posts`` acknowledged requests of 10 events; the WAL id and the last LSN."""
    last = 0
    for i in range(posts):
        status, body, _ = _post(daemon.ingest_url, 10, start=i * 10)
        assert status == 200 and body["ack"] == "archived", body
        last = body["last_lsn"]
    return _wal_id(daemon.config.parent / "data"), last


def _wal_id(data: Path) -> str:
    return (data / "wal" / "IDENTITY").read_text().strip()


def test_a_bit_flip_or_a_deleted_object_is_refused_by_name_and_loss_is_named(
    tmp_path: Path,
) -> None:
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    config = write_config(tmp_path, _archive_toml(server, "flip"), wal='retention = "keep"')
    daemon = DaemonProcess.production(config)
    data = tmp_path / "data"
    try:
        daemon.start(timeout_s=60)
        wal_id, last = _fill(daemon, 30)
        # A restart: its fences record where the archive ended.
        assert daemon.stop() == 0
        daemon.start(timeout_s=60)
        daemon.kill()
        shutil.rmtree(data)
        _run_refuses(config)
        assert not (data / "wal").exists()
        objects = _data_objects(server, "flip")
        assert len(objects) >= 5, objects
        s3 = server.client()

        # A bit flip in the middle object: refused, naming it; nothing changed.
        key, head = objects[len(objects) // 2]
        good = s3.get_object(Bucket=server.bucket, Key=key)["Body"].read()
        flipped = bytearray(good)
        flipped[-5] ^= 0x04
        s3.put_object(Bucket=server.bucket, Key=key, Body=bytes(flipped))
        got = _eventplane(config, "restore")
        assert got.returncode == 1, got.stdout + got.stderr
        assert f"archive object {object_name(head.number)} is damaged" in got.stderr
        assert f"--accept-loss-from {head.first_lsn}" in got.stderr
        assert not (data / "wal").exists() and not (data / ".restore").exists()
        s3.put_object(Bucket=server.bucket, Key=key, Body=good)

        # The last data object deleted by hand: the fences after it say so.
        key, tail = objects[-1]
        kept = s3.get_object(Bucket=server.bucket, Key=key)["Body"].read()
        s3.delete_object(Bucket=server.bucket, Key=key)
        got = _eventplane(config, "restore")
        assert got.returncode == 1, got.stdout + got.stderr
        assert f"objects end at LSN {tail.first_lsn - 1}, but a fence" in got.stderr
        assert f"would lose LSN {tail.first_lsn}..{tail.last_lsn}:" in got.stderr
        assert not (data / "wal").exists()
        s3.put_object(Bucket=server.bucket, Key=key, Body=kept)

        # An object deleted by hand: the gap is named, nothing changed.
        key, head = objects[-2]
        s3.delete_object(Bucket=server.bucket, Key=key)
        nxt = objects[-1][1]
        got = _eventplane(config, "restore")
        assert got.returncode == 1, got.stdout + got.stderr
        assert f"LSN gap before archive object {object_name(nxt.number)}" in got.stderr
        assert f"LSN {head.first_lsn}..{nxt.last_lsn}" in got.stderr
        assert not (data / "wal").exists()
        # A wrong --accept-loss-from is no consent to this loss.
        got = _eventplane(config, "restore", "--accept-loss-from", str(head.first_lsn + 1))
        assert got.returncode == 1 and not (data / "wal").exists(), got.stderr

        got = _eventplane(config, "restore", "--accept-loss-from", str(head.first_lsn))
        assert got.returncode == 0, got.stdout + got.stderr
        assert f"LOST: LSN {head.first_lsn}..{nxt.last_lsn}" in got.stdout, got.stdout
        assert f"restored WAL {wal_id}: LSN 1..{head.first_lsn - 1}," in got.stdout
        assert last == nxt.last_lsn
        restored_id, frames = _wal_frames(data / "wal")
        assert restored_id == wal_id and max(frames) < head.first_lsn

        # The restored daemon archives on above what it holds.
        daemon.start(timeout_s=60)
        status, body, _ = _post(daemon.ingest_url, 10)
        assert status == 200 and body["first_lsn"] == head.first_lsn, body
        assert _wal_id(data) == wal_id
        assert daemon.stop() == 0
        archived = _archive_contents(server, "flip")
        assert body["first_lsn"] in archived
    finally:
        daemon.stop()
        weed.stop()


@pytest.mark.parametrize("point", RESTORE_CRASH_POINTS)
def test_a_sigkill_during_restore_applies_nothing_and_a_second_restore_succeeds(
    tmp_path: Path, point: str
) -> None:
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    config = write_config(tmp_path, _archive_toml(server, "again"), wal='retention = "keep"')
    daemon = DaemonProcess.production(config)
    data = tmp_path / "data"
    try:
        daemon.start(timeout_s=60)
        wal_id, _ = _fill(daemon, 12)
        keyed = _post_keyed(daemon.ingest_url, "order-7")
        last = keyed["last_lsn"]
        assert daemon.stop() == 0
        _, before = _wal_frames(data / "wal")
        shutil.rmtree(data)

        # Mid-download: after the second object's frames are in the temp segments.
        spec = f"{point}@2" if point == "restore.mid_download" else point
        got = _eventplane(config, "restore", env={ENV_CRASH_AT: spec})
        assert f"crash point {point} reached" in got.stderr, got.stderr
        assert got.returncode == -9, got.stdout + got.stderr
        assert not (data / "wal").exists()
        _run_refuses(config)

        got = _eventplane(config, "restore")
        assert got.returncode == 0, got.stdout + got.stderr
        assert f"restored WAL {wal_id}: LSN 1..{last}," in got.stdout, got.stdout
        assert not (data / ".restore").exists()
        restored_id, frames = _wal_frames(data / "wal")
        assert restored_id == wal_id and frames == before
        daemon.start(timeout_s=60)
        # A producer's retry of a request acknowledged before the loss: its original LSNs.
        again = _post_keyed(daemon.ingest_url, "order-7")
        assert again.get("replayed") is True, again
        assert (again["first_lsn"], again["last_lsn"]) == (keyed["first_lsn"], last)
        status, body, _ = _post(daemon.ingest_url, 10)
        assert status == 200 and body["first_lsn"] == last + 1, body
        assert daemon.stop() == 0
    finally:
        daemon.stop()
        weed.stop()


def test_a_sigkill_during_an_upload_loses_no_acknowledged_event(tmp_path: Path) -> None:
    """``ack = "archived"``, killed at its 20th upload (``archive.before_put@20``)
    while producers send: the restore needs no flag, holds every acknowledged
    event, and the daemon goes on above it."""
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    config = write_config(tmp_path, _archive_toml(server, "upload"), wal='retention = "keep"')
    daemon = DaemonProcess.production(config, env={ENV_CRASH_AT: "archive.before_put@20"})
    loader = Loader("", batch=20, producers=3)
    data = tmp_path / "data"
    try:
        daemon.start(timeout_s=60)
        wal_id = _wal_id(data)
        loader.url = daemon.ingest_url
        loader.start()
        assert daemon.proc is not None
        daemon.proc.wait(timeout=60)
        assert daemon.proc.returncode == -9
        loader.stop()
        acked = loader.acked_lsns()
        assert acked
        shutil.rmtree(data)

        got = _eventplane(config, "restore")
        assert got.returncode == 0, got.stdout + got.stderr
        assert "LOST" not in got.stdout, got.stdout
        found = re.search(rf"restored WAL {wal_id}: LSN 1\.\.(\d+), ", got.stdout)
        assert found, got.stdout
        last = int(found[1])
        _, frames = _wal_frames(data / "wal")
        restored = {lsn for first, frame in frames.items() for lsn in _lsns(first, frame)}
        assert acked <= restored, sorted(acked - restored)[:10]
        assert max(acked) <= last

        daemon = DaemonProcess.production(config)
        daemon.start(timeout_s=60)
        status, body, _ = _post(daemon.ingest_url, 10)
        assert status == 200 and body["first_lsn"] == last + 1, body
        assert daemon.stop() == 0
        print(f"killed at an upload: {len(acked)} acknowledged, LSN 1..{last} restored")
    finally:
        loader.stop()
        daemon.stop()
        weed.stop()


def _lsns(first: int, frame: bytes) -> range:
    count = FRAME_HEADER.unpack_from(frame, 0)[7]
    return range(first, first + count)


def _lake(tmp_path: Path, prefix: str, ack: str) -> tuple[Weed, Path, str]:
    """A SeaweedFS, and a Spark daemon's config archiving under ``prefix`` in
    ``ack`` mode with one Delta stream on it: (weed, config, the table's URI)."""
    requires.delta_jars()
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    uri = f"s3://{weed.server.bucket}/cdc/lake"
    lake = f"""{_archive_toml(weed.server, prefix).replace('"archived"', f'"{ack}"')}
[[cdc.streams]]
name = "lake"
collections = "*"
path = "{uri}"
format = "delta"
"""
    return weed, spark_config(tmp_path, {}, extra=lake), uri


@pytest.mark.spark
def test_disaster_in_archived_mode_restores_every_acknowledged_event_exactly_once(
    tmp_path: Path,
) -> None:
    from deltalake import DeltaTable

    weed, config, uri = _lake(tmp_path, "disaster", "archived")
    server = weed.server
    daemon = DaemonProcess.production(config)
    loader = Loader("", batch=50, producers=2, pause_s=0.02)
    data = tmp_path / "data"
    try:
        t0 = time.monotonic()
        daemon.start(timeout_s=60)
        loader.url = daemon.ingest_url
        loader.start()
        wait_for(
            "the lake commits",
            lambda: stage(daemon.status(), "cdc:lake")["batch_id"] > 3,
            60,
            daemon,
        )
        wal_id = _wal_id(data)
        daemon.kill()
        loader.stop()
        acked = loader.acked_lsns()
        assert acked
        shutil.rmtree(data)
        _run_refuses(config)

        got = _eventplane(config, "restore")
        assert got.returncode == 0, got.stdout + got.stderr
        summary = got.stdout
        print("restore summary:\n" + summary)
        found = re.search(rf"restored WAL {wal_id}: LSN (\d+)\.\.(\d+), ", summary)
        assert found and "every checksum verified" in summary, summary
        first, last = int(found[1]), int(found[2])
        assert last >= max(acked)  # every acknowledged event is back
        found = re.search(r"table cdc:lake: last batch (\d+), last LSN per core \[(.*)\]", summary)
        assert found, summary
        table_batch = int(found[1])
        # What the archive pruned, every reader had: the table holds it.
        assert table_batch > 0 and first <= min(int(x) for x in found[2].split(",")) + 1

        daemon.start(timeout_s=60)
        head = daemon.status()["wal"]["head_lsn"]
        assert head >= max(acked)
        wait_for(
            "the lake catches up",
            lambda: min(c["watermark"] for c in daemon.status()["cores"]) >= head,
            60,
            daemon,
        )
        assert stage(daemon.status(), "cdc:lake")["batch_id"] > table_batch
        assert daemon.stop() == 0
        dt = DeltaTable(uri, storage_options=server.storage_options())
        rows = dt.to_pyarrow_table(columns=["lsn", "batch_id"])
        seen = Counter(rows["lsn"].to_pylist())
        assert acked <= set(seen), sorted(acked - set(seen))[:10]
        assert max(seen.values()) == 1, [k for k, v in seen.items() if v > 1][:10]
        assert set(seen) == set(range(1, head + 1))
        print(
            f"disaster: {len(acked)} acknowledged, {len(seen)} rows, {time.monotonic() - t0:.1f} s"
        )
    finally:
        loader.stop()
        daemon.stop()
        weed.stop()


@pytest.mark.spark
def test_disaster_in_local_mode_loses_at_most_the_unarchived_window_and_duplicates_nothing(
    tmp_path: Path,
) -> None:
    """``ack = "local"``, the archive's uploads hang from the fourth on while
    the lake keeps committing; SIGKILL, the data_dir deleted, restore, run."""
    from deltalake import DeltaTable

    weed, config, uri = _lake(tmp_path, "local", "local")
    server = weed.server
    daemon = DaemonProcess.production(config, env={ENV_STALL_AT: "archive.before_put@4"})
    loader = Loader("", batch=50, producers=2, pause_s=0.02)
    data = tmp_path / "data"
    try:
        daemon.start(timeout_s=60)
        loader.url = daemon.ingest_url
        loader.start()

        def lake_past_archive() -> bool:
            st = daemon.status()
            archived = st["wal"]["archive"]["archived_lsn"]
            return archived > 0 and min(c["watermark"] for c in st["cores"]) > archived + 500

        wait_for("the lake commits what the archive lacks", lake_past_archive, 90, daemon)
        loader.stop()
        acked = loader.acked_lsns()
        before = daemon.status()  # just before the kill; nothing is acknowledged after it
        window = before["wal"]["archive"]
        archived, unarchived = window["archived_lsn"], window["unarchived_events"]
        head = before["wal"]["head_lsn"]
        assert unarchived == head - archived > 0, window
        daemon.kill()
        shutil.rmtree(data)

        got = _eventplane(config, "restore")
        assert got.returncode == 0, got.stdout + got.stderr
        summary = got.stdout
        print("restore summary:\n" + summary)
        assert re.search(rf": LSN \d+\.\.{archived}, ", summary), summary
        found = re.search(r"LOST from the WAL: LSN (\d+)\.\.(\d+):", summary)
        assert found and int(found[1]) == archived + 1, summary
        top = int(found[2])
        assert archived < top <= head
        assert "restore.lsns_lost" in got.stderr

        daemon = DaemonProcess.production(config)
        daemon.start(timeout_s=60)
        st = daemon.status()
        assert st["wal"]["lost"] == [[archived + 1, top]], st["wal"]
        assert st["wal"]["head_lsn"] == top
        status, body, _ = _post(daemon.ingest_url, 20)
        assert status == 200 and body["first_lsn"] == top + 1, body
        after = set(range(body["first_lsn"], body["last_lsn"] + 1))
        wait_for(
            "the lake takes the new events",
            lambda: min(c["watermark"] for c in daemon.status()["cores"]) >= body["last_lsn"],
            60,
            daemon,
        )
        wait_for(
            "the lost frame and the new events are archived",
            lambda: daemon.status()["wal"]["archive"]["archived_lsn"] >= body["last_lsn"],
            30,
            daemon,
        )
        assert daemon.stop() == 0
        dt = DeltaTable(uri, storage_options=server.storage_options())
        seen = Counter(dt.to_pyarrow_table(columns=["lsn"])["lsn"].to_pylist())
        assert max(seen.values()) == 1, [k for k, v in seen.items() if v > 1][:10]
        assert set(range(1, archived + 1)) <= set(seen)  # every archived event, once
        assert after <= set(seen)
        lost = acked - set(seen)
        assert all(archived < lsn <= head for lsn in lost), sorted(lost)[:10]
        assert len(lost) <= unarchived
        assert not {lsn for lsn in seen if top < lsn < min(after)}
        print(
            f"local disaster: {len(acked)} acknowledged, archived to LSN {archived}, "
            f"{unarchived} unarchived at the kill, lake to LSN {top}, {len(lost)} lost"
        )
    finally:
        loader.stop()
        daemon.stop()
        weed.stop()
