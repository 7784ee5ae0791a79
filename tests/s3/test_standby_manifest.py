"""A standby's read of the archive's manifest (daemon.walarchive.ManifestWatch)
against a real S3 server, in process: it names the holder only while its lease
is live, and health names an archive it cannot read once that lasts."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from pathlib import Path

import pytest

from daemon.config import S3Config, WalArchiveConfig
from daemon.metrics import Metrics
from daemon.walarchive import ManifestWatch, WalArchive
from tests.s3.server import S3Server
from wal import Wal

pytestmark = pytest.mark.timeout(120)
TTL_S, SKEW_S = 4.0, 1.0


def _s3cfg(server: S3Server) -> S3Config:
    return server.config(
        lease_ttl_s=TTL_S,
        lease_skew_s=SKEW_S,
        connect_timeout_s=1,
        request_timeout_s=1,
        max_retries=0,
    )


def test_the_holder_is_the_primary_only_while_its_lease_is_live(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """1. No manifest yet: no primary.
    2. A primary takes it: the watch names its host, epoch and pid.
    3. Its lease past expires_at + skew by the standby's clock: no primary.
    4. A clean stop releases it: no primary, whatever the clock."""
    uri = f"s3://{s3_server.bucket}/watch-{uuid.uuid4().hex[:8]}"
    cfg = WalArchiveConfig(uri=uri, role="standby")
    now = {"t": 0.0}
    watch = ManifestWatch(cfg, _s3cfg(s3_server), clock=lambda: time.time() + now["t"])
    assert watch.interval_s == (TTL_S - SKEW_S) / 3

    async def run() -> None:
        watch.read()
        assert (watch.primary(), watch.manifest, watch.error) == (None, None, None)
        wal = Wal.open(tmp_path / "wal")
        archive = WalArchive(
            WalArchiveConfig(uri=uri),
            _s3cfg(s3_server),
            wal,
            str(tmp_path),
            Metrics(cores=4),
        )
        try:
            await archive.open()
            watch.read()
            assert watch.primary() == socket.gethostname()
            st = watch.status()
            assert (st["held"], st["epoch"], st["wal_id"]) == (True, 1, wal.wal_id)
            assert st["holder"]["data_dir"] == str(tmp_path)
            now["t"] = TTL_S + SKEW_S + 1  # the holder stopped renewing, by this clock
            assert watch.primary() is None and watch.status()["held"] is False
            now["t"] = 0.0
            await archive.stop(1.0)
            watch.read()
            assert watch.primary() is None and watch.manifest is not None
            assert watch.manifest["released"] is True
        finally:
            wal.close()

    asyncio.run(run())


def test_an_unreadable_archive_is_a_health_problem_once_it_lasts(s3_server: S3Server) -> None:
    uri = f"s3://{s3_server.bucket}/watch-{uuid.uuid4().hex[:8]}"
    now = {"t": 1000.0}
    s3cfg = _s3cfg(s3_server)
    watch = ManifestWatch(
        WalArchiveConfig(uri=uri, role="standby"),
        s3cfg,
        s3=s3_server.client(secret_key="wrong"),
        clock=lambda: now["t"],
    )
    watch.read()
    assert watch.error is not None and f"cannot read {uri}/manifest.json" in watch.error
    assert watch.problem(stall_after_s=30) is None
    now["t"] += 31
    problem = watch.problem(stall_after_s=30)
    assert problem is not None
    assert problem.startswith("the standby has not read the archive's manifest for 31 s")
    assert watch.status()["error"] == watch.error
