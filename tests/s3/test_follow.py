"""A standby's copy of the archive (daemon/follow.py) against a real S3 server,
fed by a real WalArchive: it holds every object checked whole, follows what
comes, drops what the primary pruned, keeps no damaged object, survives a
restart (its packs read back)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from daemon.config import WalArchiveConfig
from daemon.follow import Follower
from tests.s3.server import S3Server
from tests.s3.test_wal_archive import _append, _archive
from wal import Wal
from wal.archive import object_name, parse_object

pytestmark = pytest.mark.timeout(120)


def _follower(server: S3Server, uri: str, data_dir: Path) -> Follower:
    s3cfg = server.config(lease_ttl_s=4.0, lease_skew_s=1.0, max_retries=0)
    return Follower(WalArchiveConfig(uri=uri, role="standby"), s3cfg, data_dir)


def test_the_copy_follows_every_object_drops_pruned_ones_and_keeps_no_damaged_one(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """1. A primary archives 30 groups; one poll copies every object, checked:
       the copy's bytes are the store's, followed to the primary's last LSN.
    2. More groups: the lag is measured before the next poll's downloads, and
       that poll catches up.
    3. The primary prunes: the copy drops the same objects.
    4. A damaged object in the store is not kept; a new Follower on the same
       directory (a restarted standby) loads the copy it finds."""
    prefix = f"follow-{uuid.uuid4().hex[:8]}"
    uri = f"s3://{s3_server.bucket}/{prefix}"
    s3 = s3_server.client()

    async def primary_appends(wal: Wal, archive: object, start: int, groups: int) -> int:
        last = await _append(wal, start, groups)
        await archive.until_archived(last)  # type: ignore[attr-defined]
        return last

    async def run() -> None:
        wal = Wal.open(tmp_path / "a" / "wal", segment_bytes=8192)
        archive = _archive(s3_server, wal, uri, tmp_path / "a", ack="archived", flush_ms=5)
        await archive.open()
        archive.forward = lambda batches: None
        archive.start()
        wal.set_batch_listener(archive.on_durable_batches)
        follower = _follower(s3_server, uri, tmp_path / "b")
        follower.wal_id = wal.wal_id
        try:
            # Step 1. Everything, checked
            last = await primary_appends(wal, archive, 0, 30)
            assert follower.poll() > 0
            assert follower.followed_lsn == last == 210
            listed = [
                o["Key"]
                for o in s3.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/wal/")[
                    "Contents"
                ]
            ]
            for key in listed:
                number = int(key.rsplit("/", 1)[1])
                body = s3.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
                assert follower.read(number) == body, key
            assert set(follower.cached) == {int(k.rsplit("/", 1)[1]) for k in listed}
            # Step 2. The lag, then caught up
            last = await primary_appends(wal, archive, 1000, 10)
            assert follower.poll() > 0
            assert follower.lag_lsns == last - 210 and follower.lag_s >= 0
            assert follower.followed_lsn == last
            assert follower.poll() == 0 and follower.lag_lsns == 0 and follower.lag_s == 0
            # Step 3. Pruned there, dropped here
            before = set(follower.cached)
            assert archive.prune(200) > 0
            follower.poll()
            gone = before - set(follower.cached)
            assert gone and all(follower.read(n) is None for n in gone)
            assert len(list(follower.dir.iterdir())) < 3  # the packs of pruned objects went
            # Step 4. A damaged object is not kept
            top = max(follower.cached) + 1
            await primary_appends(wal, archive, 2000, 1)
            key = f"{prefix}/wal/{object_name(top)}"
            body = bytearray(s3.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
            parse_object(bytes(body))
            body[-3] ^= 0x40
            s3.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(body))
            follower.poll()
            assert top not in follower.cached and follower.read(top) is None
            again = _follower(s3_server, uri, tmp_path / "b")
            again.wal_id = wal.wal_id
            assert set(follower.cached) <= set(again.cached)  # and pruned ones, until a poll
            assert again.poll() == 0
            assert again.cached == follower.cached
            assert again.followed_lsn == follower.followed_lsn
            assert all(again.read(n) == follower.read(n) for n in follower.cached)
        finally:
            await archive.stop(1)
            wal.close()

    asyncio.run(run())
