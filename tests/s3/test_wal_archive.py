"""The WAL archive (daemon/walarchive.py) against a real S3 server, in process:
its objects hold exactly the WAL's frames (every checksum verified), the
stages get each group in LSN order and only once it is archived, local
segments go only once archived, a data_dir of another WAL is refused naming
both, and a new holder's fence stops the old one at its next upload."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from daemon.config import WalArchiveConfig
from daemon.errors import ArchiveRefusedError, ArchiveUnavailable
from daemon.metrics import Metrics
from daemon.walarchive import MANIFEST, ArchivedWal, WalArchive
from tests.s3.server import S3Server
from wal import Wal
from wal.archive import object_name, parse_object

pytestmark = pytest.mark.timeout(120)


def _archive(server: S3Server, wal: Wal, uri: str, data_dir: Path, **kw: Any) -> WalArchive:
    s3cfg = server.config(
        lease_ttl_s=4.0, lease_skew_s=1.0, connect_timeout_s=1, request_timeout_s=1, max_retries=0
    )
    return WalArchive(WalArchiveConfig(uri=uri, **kw), s3cfg, wal, str(data_dir), Metrics(cores=4))


def _objects(server: S3Server, prefix: str) -> list[tuple[Any, list[tuple[int, int, bytes]]]]:
    s3 = server.client()
    keys = [
        o["Key"]
        for o in s3.list_objects_v2(Bucket=server.bucket, Prefix=f"{prefix}/wal/").get(
            "Contents", []
        )
    ]
    out = []
    for key in sorted(keys):
        body = s3.get_object(Bucket=server.bucket, Key=key)["Body"].read()
        out.append(parse_object(body))  # every CRC: header, body, each frame
    return out


async def _append(wal: Wal, start: int, groups: int, per: int = 7) -> int:
    last = 0
    for g in range(groups):
        items = [
            (i % 4, b'{"n":%d,"pad":"%s"}' % (start + g * per + i, b"x" * 90)) for i in range(per)
        ]
        _, last = await wal.append(items)
    return last


def test_the_archive_holds_exactly_the_wals_frames_and_gates_retention(
    s3_server: S3Server, tmp_path: Path
) -> None:
    prefix = f"arch-{uuid.uuid4().hex[:8]}"
    uri = f"s3://{s3_server.bucket}/{prefix}"

    async def run() -> None:
        wal = Wal.open(tmp_path / "wal", segment_bytes=8192)
        archive = _archive(s3_server, wal, uri, tmp_path, ack="archived", flush_ms=20)
        await archive.open()
        got: list[list[int]] = []  # the LSNs of each group the stages were handed

        def forward(batches: Any) -> None:
            lsns = sorted(lsn for b in batches for lsn in b.lsns)
            assert lsns[-1] <= archive.archived_lsn, "a stage got an unarchived event"
            got.append(lsns)

        archive.forward = forward
        archive.start()
        wal.set_batch_listener(archive.on_durable_batches)
        view = ArchivedWal(wal, archive)
        # Concurrent appends: uploads overlap.
        lasts = await asyncio.gather(*(_append(wal, 1000 * k, 20) for k in range(5)))
        head = wal.head_lsn()
        assert max(lasts) == head == 5 * 20 * 7
        await archive.until_archived(head)
        assert archive.archived_lsn == head and archive.refusal() is None
        # The stages' view: every event, and only once archived.
        assert view.head_lsn() == head
        # In LSN order, each once, as the groups were made.
        assert [lsn for lsns in got for lsn in lsns] == list(range(1, head + 1))
        # Content: the objects' frames, fences aside, are the WAL's frames from LSN 1.
        objects = _objects(s3_server, prefix)
        data = [f for head_, frames in objects if not head_.fence for f in frames]
        assert objects[0][0].fence and objects[0][0].epoch == 1
        local = {f[0]: f[2] for f in wal.read_frames(1)}
        lsn = 1
        for first, events, raw in data:
            assert first == lsn and local[first] == raw
            lsn += events
        assert lsn == head + 1
        # Retention: segments go only below the archived LSN, and so do the
        # archive's data objects (the newest stays, and every fence).
        archived = archive.archived_lsn
        assert view.truncate_below(head + 1) >= 1
        assert wal.retained_floor() <= archived + 1
        left = _objects(s3_server, prefix)
        assert [h.last_lsn for h, _ in left if not h.fence] == [head]
        assert sum(h.fence for h, _ in left) == sum(h.fence for h, _ in objects)
        await archive.stop(5)
        wal.close()
        # A restart of the same data_dir continues: epoch 2, nothing to upload.
        wal = Wal.open(tmp_path / "wal", segment_bytes=8192)
        again = _archive(s3_server, wal, uri, tmp_path)
        await again.open()
        assert (again.epoch, again.archived_lsn) == (2, head)
        await again.stop(1)
        wal.close()

    asyncio.run(run())


def test_objects_of_an_earlier_process_are_pruned_once_every_stage_is_past_them(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """1. A holder archives 20 groups and stops (no retention ran).
    2. The same data_dir starts again and archives 5 more: retention past
       every LSN removes the first process's data objects too, keeping the
       newest object and every fence (before, only this process's went)."""
    prefix = f"arch-{uuid.uuid4().hex[:8]}"
    uri = f"s3://{s3_server.bucket}/{prefix}"

    async def run() -> None:
        for start, groups in ((0, 20), (1000, 5)):
            wal = Wal.open(tmp_path / "wal", segment_bytes=8192)
            archive = _archive(s3_server, wal, uri, tmp_path, ack="archived", flush_ms=5)
            await archive.open()
            archive.forward = lambda batches: None
            archive.start()
            wal.set_batch_listener(archive.on_durable_batches)
            last = await _append(wal, start, groups)
            await archive.until_archived(last)
            if start:
                before = [h for h, _ in _objects(s3_server, prefix) if not h.fence]
                assert min(h.first_lsn for h in before) == 1, "the first run's objects"
                ArchivedWal(wal, archive).truncate_below(last + 1)
                left = _objects(s3_server, prefix)
                assert [h.last_lsn for h, _ in left if not h.fence] == [last]
                assert sum(h.fence for h, _ in left) == 2 * 4  # each start's fences
            await archive.stop(1)
            wal.close()

    asyncio.run(run())


def test_a_data_dir_of_another_wal_is_refused_naming_both(
    s3_server: S3Server, tmp_path: Path
) -> None:
    uri = f"s3://{s3_server.bucket}/arch-{uuid.uuid4().hex[:8]}"

    async def run() -> None:
        first = Wal.open(tmp_path / "a" / "wal")
        a = _archive(s3_server, first, uri, tmp_path / "a")
        await a.open()
        await a.stop(1)
        other = Wal.open(tmp_path / "b" / "wal")
        b = _archive(s3_server, other, uri, tmp_path / "b")
        with pytest.raises(ArchiveRefusedError) as info:
            await b.open()
        assert first.wal_id in str(info.value) and other.wal_id in str(info.value)
        first.close()
        other.close()

    asyncio.run(run())


def test_a_new_holders_fence_fails_the_old_holders_next_upload(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The old holder's lease lapses (its renewals stop, as in a paused
    process); a second holder takes the manifest and writes its fences; the
    old holder's next upload collides with a fence: it is fenced and
    acknowledges nothing more."""
    prefix = f"arch-{uuid.uuid4().hex[:8]}"
    uri = f"s3://{s3_server.bucket}/{prefix}"

    async def run() -> None:
        wal = Wal.open(tmp_path / "a" / "wal")
        old = _archive(s3_server, wal, uri, tmp_path / "a", ack="archived", flush_ms=10)
        await old.open()
        old.forward = lambda batches: None
        old.start()
        wal.set_batch_listener(old.on_durable_batches)
        last = await _append(wal, 0, 10)
        await old.until_archived(last)
        # Pause: no renewal from here on (the upload task stays).
        old._tasks[1].cancel()
        await asyncio.sleep(4.0 + 1.0 + 0.5)  # past expires_at + skew
        # The second holder: a copy of the same WAL (same id) elsewhere.
        shutil.copytree(tmp_path / "a" / "wal", tmp_path / "b" / "wal", ignore=_no_lock)
        copy = Wal.open(tmp_path / "b" / "wal")
        new = _archive(s3_server, copy, uri, tmp_path / "b")
        await new.open()
        assert new.epoch == old.epoch + 1 and new.archived_lsn == last
        # The old holder wakes up: its next upload fails at the fence.
        more = await _append(wal, 10_000, 3)
        with pytest.raises(ArchiveUnavailable) as info:
            await old.until_archived(more)
        assert info.value.fenced and "fenced" in str(info.value)
        assert old.fenced is not None and old.archived_lsn == last
        assert old.refusal() == old.fenced
        assert "taken" in old.problem(30.0)  # type: ignore[operator]
        manifest = s3_server.client().get_object(
            Bucket=s3_server.bucket, Key=f"{prefix}/{MANIFEST}"
        )
        assert b'"epoch":%d' % new.epoch in manifest["Body"].read()
        await old.stop(1)
        await new.stop(1)
        wal.close()
        copy.close()

    asyncio.run(run())


def test_a_local_mode_holder_taken_over_names_the_lsns_only_its_wal_has(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """``ack = "local"``: the old holder stops renewing and uploading after 10
    archived groups, acknowledges 3 more (local), and a second holder takes
    over from a copy of the WAL made before them. The old holder's next
    renewal finds the manifest taken: it is fenced, and its message and log
    name the LSNs that only its WAL holds."""
    from structlog.testing import capture_logs

    prefix = f"arch-{uuid.uuid4().hex[:8]}"
    uri = f"s3://{s3_server.bucket}/{prefix}"

    async def run() -> None:
        wal = Wal.open(tmp_path / "a" / "wal")
        old = _archive(s3_server, wal, uri, tmp_path / "a", ack="local", flush_ms=10)
        await old.open()
        old.forward = lambda batches: None
        old.start()
        wal.set_batch_listener(old.on_durable_batches)
        last = await _append(wal, 0, 10)
        await old.until_archived(last)
        for task in old._tasks:  # paused: no upload, no renewal
            task.cancel()
        shutil.copytree(tmp_path / "a" / "wal", tmp_path / "b" / "wal", ignore=_no_lock)
        more = await _append(wal, 10_000, 3)
        await asyncio.sleep(4.0 + 1.0 + 0.5)  # past expires_at + skew
        copy = Wal.open(tmp_path / "b" / "wal")
        new = _archive(s3_server, copy, uri, tmp_path / "b")
        await new.open()
        with capture_logs() as logs:
            await old._renew()  # woken: the next renewal
        assert old.fenced is not None and "taken over" in old.fenced
        assert f"LSN {last + 1}..{more} are in this daemon's WAL only" in old.fenced
        assert old.lease_refusal() == old.fenced
        event = next(e for e in logs if e["event"] == "archive.unarchived_after_fence")
        assert (event["first_lsn"], event["last_lsn"]) == (last + 1, more)
        await old.stop(1)
        await new.stop(1)
        wal.close()
        copy.close()

    asyncio.run(run())


def _no_lock(_dir: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "LOCK"]


def test_check_config_reaches_the_archives_bucket(s3_server: S3Server) -> None:
    import dataclasses
    import io

    from daemon import config
    from daemon.cli import checkconfig

    def check(uri: str) -> tuple[int, str]:
        parsed = config.parse({"wal": {"archive": {"uri": uri}}})
        parsed = dataclasses.replace(parsed, s3=s3_server.config())
        err = io.StringIO()
        return checkconfig.main(parsed, spark=False, out=io.StringIO(), err=err), err.getvalue()

    assert check(f"s3://{s3_server.bucket}/archive")[0] == 0
    code, err = check("s3://no-such-bucket/archive")
    assert code == 2 and "wal.archive.uri" in err and "does not exist" in err, err


def test_an_upload_that_never_landed_before_a_later_one_is_archived_again_by_the_next_holder(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """1. A holder archives its WAL in several objects; then the second-to-last
    object is taken away: what a SIGKILL leaves when one upload of several in
    flight never landed and a later one did.
    2. The next holder of the same data_dir fences the missing name: the later
    object does not count, the archived LSN is the end of the object before the
    gap, and the rest is uploaded again.
    3. The archive's counting objects then hold every LSN from 1, contiguous."""
    prefix = f"arch-{uuid.uuid4().hex[:8]}"
    uri = f"s3://{s3_server.bucket}/{prefix}"
    s3 = s3_server.client()

    async def run() -> None:
        wal = Wal.open(tmp_path / "wal", segment_bytes=8192)
        first = _archive(s3_server, wal, uri, tmp_path, ack="archived", flush_ms=10)
        await first.open()
        first.forward = lambda batches: None
        first.start()
        wal.set_batch_listener(first.on_durable_batches)
        for k in range(4):  # one object each: every append waits for its upload
            await first.until_archived(await _append(wal, 100 * k, 5))
        head = wal.head_lsn()
        await first.stop(5)
        data = [(h, frames) for h, frames in _objects(s3_server, prefix) if not h.fence]
        assert len(data) >= 3
        (before, _), (lost, _), (later, _) = data[-3:]
        assert later.last_lsn == head
        s3.delete_object(Bucket=s3_server.bucket, Key=f"{prefix}/wal/{object_name(lost.number)}")

        nxt = _archive(s3_server, wal, uri, tmp_path, ack="archived", flush_ms=10)
        await nxt.open()
        assert nxt.archived_lsn == before.last_lsn, (nxt.archived_lsn, before, later)
        nxt.forward = lambda batches: None
        nxt.start()
        await nxt.until_archived(head)
        await nxt.stop(5)
        wal.close()

        # What counts, as a restore reads it: a fence masks older epochs after it.
        lsn, masked = 1, 0
        for h, frames in _objects(s3_server, prefix):
            if h.fence:
                masked = max(masked, h.epoch)
                continue
            if h.epoch < masked:
                continue
            for f_first, events, _raw in frames:
                assert f_first == lsn, f"LSN {lsn} missing before {f_first} in {h}"
                lsn += events
        assert lsn == head + 1

    asyncio.run(run())
