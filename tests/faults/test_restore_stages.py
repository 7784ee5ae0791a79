"""``eventplane restore`` brings back every kind of stage, not only CDC streams
(daemon/restore.py, docs/operating.md "Losing the machine"): real daemons,
a real SeaweedFS (tests/s3/server.py), ``ack = "archived"``.

1. A mirror on S3 (no JVM): producers of inserts, updates and deletes,
   SIGKILL, the data_dir deleted, restore, run, more events, every request
   without an answer sent again with its ``Idempotency-Key``: the mirror is
   the fold of every acknowledged event and no batch id is in two merges.
   Two mirrors whose last merges are batches apart, with a batch neither
   merged between (each batch has one collection only): after restore and
   run each is the fold of its own.
2. Triggers (real Spark), their webhook receiver down while events arrive, so
   every matching row waits in the retry queue while the stage and a mirror
   on S3 commit and retention runs: SIGKILL, the data_dir deleted, restore,
   the receiver back, run: every matching acknowledged row is delivered at
   least once with its key (the archive kept the queued rows: the retention
   floor holds for them; the restored trigger stage evaluates from it).
3. The DLQ (real Spark): rows a failing receiver dead-lettered come back
   from the archive's copy, every column and id.
4. A SIGKILL with uploads in flight that never landed (made here by taking
   one of the last objects away): with ``ack = "archived"`` the restore keeps
   what is contiguous and names the LSNs above as never acknowledged, no flag
   needed; a hole deeper than the uploads a holder keeps in flight, and any
   gap with ``ack = "local"``, still ask for ``--accept-loss-from``.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from daemon import dlqcopy
from tests import requires
from tests.faults.receivers import Receiver
from tests.faults.support import spark_config, stage, wait_for
from tests.faults.test_restore import (
    _archive_toml,
    _data_objects,
    _eventplane,
    _run_refuses,
    _wal_frames,
)
from tests.faults.test_wal_archive import _post
from tests.integration.harness import DaemonProcess, make_events, write_config
from tests.integration.test_crash_recording import _wait_caught_up
from tests.integration.test_mirror_crash import Producers, fold, post
from tests.s3.server import start_weed
from triggers.store import store_path

pytestmark = [pytest.mark.crash, pytest.mark.timeout(300)]


def test_a_mirror_on_s3_after_a_restore_is_the_fold_of_every_acknowledged_event(
    tmp_path: Path,
) -> None:
    from deltalake import DeltaTable

    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    uri = f"s3://{server.bucket}/mirrors/orders"
    extra = f"""{_archive_toml(server, "mirror")}
[[cdc.mirrors]]
name = "orders"
collection = "orders"
path = "{uri}"
columns = {{ amount = "double", n = "long" }}
buckets = 4
"""
    config = write_config(tmp_path, extra, cores=2, interval_ms=100)
    daemon = DaemonProcess.production(config)
    rng = random.Random(42)
    data = tmp_path / "data"
    acked = []
    try:
        daemon.start(timeout_s=60)
        producers = Producers(daemon.ingest_url, rng, threads=2)
        producers.start()
        try:
            wait_for(
                "the mirror commits",
                lambda: stage(daemon.status(), "mirror:orders")["batch_id"] > 5,
                60,
                daemon,
            )
            daemon.kill()
        finally:
            producers.stop()
        acked += producers.acked
        shutil.rmtree(data)
        _run_refuses(config)

        got = _eventplane(config, "restore")
        assert got.returncode == 0, got.stdout + got.stderr
        found = re.search(r"table mirror:orders: last batch (\d+)", got.stdout)
        mirrored = int(found[1]) if found else 0

        daemon.start(timeout_s=60)
        more = Producers(daemon.ingest_url, rng, threads=2)
        more.start()
        time.sleep(2.0)
        more.stop()
        acked += more.acked
        for key, evs in producers.unanswered + more.unanswered:
            acked.append((post(daemon.ingest_url, evs, key), evs))
        _wait_caught_up(daemon, timeout_s=120)
        assert stage(daemon.status(), "mirror:orders")["batch_id"] > mirrored
        assert daemon.stop() == 0
        table = DeltaTable(uri, storage_options=server.storage_options())
        rows = table.to_pyarrow_table().to_pylist()
        got_state = {r["key"]: (r["lsn"], json.loads(r["doc"])) for r in rows}
        want = fold(acked)
        assert len(got_state) == len(rows), "a key has two rows"
        wrong = sorted(k for k in set(want) | set(got_state) if want.get(k) != got_state.get(k))
        assert not wrong, [(k, want.get(k), got_state.get(k)) for k in wrong[:5]]
        assert mirrored > 0, "the summary names the mirror's last batch"
        merges = [
            json.loads(h["userMetadata"])["eventplane"]["batch_id"]
            for h in table.history()
            if h.get("operation") == "MERGE"
        ]
        assert len(merges) == len(set(merges)), "a batch id in two merges"
    finally:
        daemon.stop()
        weed.stop()


def _hook(receiver: Receiver, *, max_attempts: int, backoff_ms: tuple[int, int]) -> str:
    """The webhook trigger ``hook`` on collection ``c1``, posting to ``receiver``."""
    first, most = backoff_ms
    return f"""
[[triggers]]
name = "hook"
collection = "c1"
action = {{ type = "webhook", url = "{receiver.url}" }}
retry = {{ max_attempts = {max_attempts}, initial_backoff_ms = {first}, max_backoff_ms = {most} }}
"""


@pytest.mark.spark
def test_every_matching_row_queued_for_retry_is_delivered_after_a_restore(
    tmp_path: Path,
) -> None:
    requires.delta_jars()
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    receiver = Receiver(status=503)
    extra = f"""{_archive_toml(server, "triggers")}
[consumer]
watermark_flush_ms = 200

[[cdc.mirrors]]
name = "c0"
collection = "c0"
path = "s3://{server.bucket}/mirrors/c0"
buckets = 2

{_hook(receiver, max_attempts=100000, backoff_ms=(200, 500))}"""
    config = spark_config(tmp_path, {}, extra=extra)
    daemon = DaemonProcess.production(config)
    data = tmp_path / "data"
    matching: set[int] = set()
    try:
        daemon.start(timeout_s=120)
        last = 0
        for i in range(30):
            status, body, _ = _post(daemon.ingest_url, 10, start=i * 10)
            assert status == 200 and body["ack"] == "archived", body
            events = make_events(i * 10, 10)
            matching |= {
                body["first_lsn"] + j for j, e in enumerate(events) if e["collection"] == "c1"
            }
            last = body["last_lsn"]
        wait_for(
            "every stage past the last event, the rows in the retry queue",
            lambda: (
                (st := daemon.status())["retry_queue"]["depth"] > 0
                and min(c["watermark"] for c in st["cores"]) >= last
            ),
            120,
            daemon,
        )
        time.sleep(2.0)  # watermark flushes, and retention with them
        daemon.kill()
        assert not receiver.rows
        shutil.rmtree(data)
        _run_refuses(config)

        got = _eventplane(config, "restore")
        assert got.returncode == 0, got.stdout + got.stderr
        print("restore summary:\n" + got.stdout)
        receiver.status = 200
        daemon.start(timeout_s=120)
        wait_for(
            "every matching row delivered",
            lambda: matching <= receiver.lsns(),
            120,
            daemon,
        )
        keys = {(int(r["lsn"]), r["idempotency_key"]) for r in receiver.rows}
        assert {(lsn, f"hook:{lsn}") for lsn in matching} <= keys
        assert daemon.stop() == 0
    finally:
        daemon.stop()
        receiver.close()
        weed.stop()


@pytest.mark.spark
def test_the_dlq_comes_back_from_the_archives_copy_after_a_restore(tmp_path: Path) -> None:
    """A webhook receiver that always fails: the rows reach the DLQ, the
    archive's copy of it follows (daemon/dlqcopy.py); SIGKILL, the data_dir
    deleted, restore: the DLQ has every entry, ids included."""
    requires.delta_jars()
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    receiver = Receiver(status=500)
    extra = _archive_toml(server, "dlq") + _hook(receiver, max_attempts=2, backoff_ms=(100, 200))
    config = spark_config(tmp_path, {}, extra=extra)
    daemon = DaemonProcess.production(config)
    data = tmp_path / "data"
    try:
        daemon.start(timeout_s=120)
        for i in range(10):
            status, body, _ = _post(daemon.ingest_url, 10, start=i * 10)
            assert status == 200, body
        wait_for(
            "the DLQ holds rows and its copy is in the archive",
            lambda: (
                (st := daemon.status())["dlq"]["entries"] > 0
                and st["retry_queue"]["depth"] == 0
                and (st["wal"]["archive"]["dlq_copy"] or {}).get("entries") == st["dlq"]["entries"]
            ),
            120,
            daemon,
        )
        got = dlqcopy.read_dlq(store_path(data))
        assert got is not None and got[1]
        before = got[1]
        daemon.kill()
        shutil.rmtree(data)

        got = _eventplane(config, "restore")
        assert got.returncode == 0, got.stdout + got.stderr
        print("restore summary:\n" + got.stdout)
        assert f"DLQ: {len(before)} entries from the archive's copy of " in got.stdout
        after = dlqcopy.read_dlq(store_path(data))
        assert after is not None and after[1] == before
        listed = _eventplane(config, "dlq", "list")
        assert listed.returncode == 0, listed.stdout + listed.stderr
        assert f"{before[0][0]}" in listed.stdout and "hook" in listed.stdout, listed.stdout
    finally:
        daemon.stop()
        receiver.close()
        weed.stop()


def _killed_with_objects(tmp_path: Path, ack: str) -> tuple[Any, Any, Path, list[Any]]:
    """A daemon filled in ``ack`` mode and SIGKILLed, its data_dir deleted: the
    SeaweedFS, the config and the archive's data objects (key, header)."""
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    toml = _archive_toml(server, "gap").replace('ack = "archived"', f'ack = "{ack}"')
    config = write_config(tmp_path, toml, wal='retention = "keep"')
    daemon = DaemonProcess.production(config)
    try:
        daemon.start(timeout_s=60)
        for i in range(20):
            status, body, _ = _post(daemon.ingest_url, 10, start=i * 10)
            assert status == 200 and body["ack"] == ack, body
            time.sleep(0.06)  # past flush_ms: one object per request or so
        time.sleep(0.5)
        daemon.kill()
    except BaseException:
        daemon.stop()
        weed.stop()
        raise
    shutil.rmtree(tmp_path / "data")
    objects = _data_objects(server, "gap")
    assert len(objects) >= 8, objects
    return weed, server, config, objects


def test_uploads_that_never_landed_are_named_never_acknowledged_and_need_no_flag(
    tmp_path: Path,
) -> None:
    weed, server, config, objects = _killed_with_objects(tmp_path, "archived")
    s3 = server.client()
    daemon = DaemonProcess.production(config)
    try:
        # A hole deeper than the uploads in flight: an object deleted by hand.
        key, head = objects[-6]
        kept = s3.get_object(Bucket=server.bucket, Key=key)["Body"].read()
        s3.delete_object(Bucket=server.bucket, Key=key)
        got = _eventplane(config, "restore")
        assert got.returncode == 1, got.stdout + got.stderr
        assert f"--accept-loss-from {head.first_lsn}" in got.stderr, got.stderr
        assert not (tmp_path / "data" / "wal").exists()
        s3.put_object(Bucket=server.bucket, Key=key, Body=kept)

        # The last upload but one never landed, the last one did.
        key, head = objects[-2]
        tail = objects[-1][1]
        s3.delete_object(Bucket=server.bucket, Key=key)
        got = _eventplane(config, "restore")
        assert got.returncode == 0, got.stdout + got.stderr
        assert f"never acknowledged: LSN {head.first_lsn}..{tail.last_lsn} " in got.stdout
        assert f": LSN 1..{head.first_lsn - 1}," in got.stdout, got.stdout
        assert "LOST" not in got.stdout
        _, frames = _wal_frames(tmp_path / "data" / "wal")
        assert max(frames) < head.first_lsn
        daemon.start(timeout_s=60)
        status, body, _ = _post(daemon.ingest_url, 10)
        assert status == 200 and body["first_lsn"] == head.first_lsn, body
        assert daemon.stop() == 0
    finally:
        daemon.stop()
        weed.stop()


def test_with_ack_local_a_gap_after_a_kill_still_asks_for_accept_loss_from(
    tmp_path: Path,
) -> None:
    weed, server, config, objects = _killed_with_objects(tmp_path, "local")
    try:
        key, head = objects[-2]
        server.client().delete_object(Bucket=server.bucket, Key=key)
        got = _eventplane(config, "restore")
        assert got.returncode == 1, got.stdout + got.stderr
        assert f"--accept-loss-from {head.first_lsn}" in got.stderr, got.stderr
        assert not (tmp_path / "data" / "wal").exists()
        got = _eventplane(config, "restore", "--accept-loss-from", str(head.first_lsn))
        assert got.returncode == 0 and f"LOST: LSN {head.first_lsn}.." in got.stdout, got.stdout
    finally:
        weed.stop()


def _posts_of(url: str, collection: str, i: int) -> tuple[int, list[dict[str, Any]]]:
    evs = [
        {"collection": collection, "op": "insert", "key": f"k{(i * 3 + j) % 7}", "new": {"n": i}}
        for j in range(3)
    ]
    return post(url, evs, f"{collection}-{i}"), evs


def test_mirrors_batches_apart_are_each_the_fold_of_their_collection_after_a_restore(
    tmp_path: Path,
) -> None:
    from deltalake import DeltaTable

    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    mirrors = "".join(
        f"""
[[cdc.mirrors]]
name = "{c}"
collection = "{c}"
path = "s3://{server.bucket}/mirrors/{c}"
buckets = 2
"""
        for c in ("a", "b")
    )
    config = write_config(tmp_path, _archive_toml(server, "two") + mirrors, cores=2)
    daemon = DaemonProcess.production(config)
    acked: dict[str, list[tuple[int, list[dict[str, Any]]]]] = {"a": [], "b": []}

    def one_batch(collection: str, i: int) -> None:
        posted = _posts_of(daemon.ingest_url, collection, i)
        acked.setdefault(collection, []).append(posted)
        name = f"mirror:{'a' if collection == 'c' else collection}"
        before = stage(daemon.status(), name)["batch_id"]
        wait_for(name, lambda: stage(daemon.status(), name)["batch_id"] > before, 30, daemon)

    try:
        daemon.start(timeout_s=60)
        one_batch("a", 0)
        one_batch("c", 1)  # a batch no mirror merges: no table records it
        for i in range(2, 8):  # b's last merge 6 batches above a's
            one_batch("b", i)
        daemon.kill()
        shutil.rmtree(tmp_path / "data")
        got = _eventplane(config, "restore")
        assert got.returncode == 0, got.stdout + got.stderr
        print("restore summary:\n" + got.stdout)
        daemon.start(timeout_s=60)
        for i in range(7, 13):
            one_batch("a" if i % 2 else "b", i)
        _wait_caught_up(daemon, timeout_s=60)
        assert daemon.stop() == 0
        for c in ("a", "b"):
            table = DeltaTable(
                f"s3://{server.bucket}/mirrors/{c}", storage_options=server.storage_options()
            )
            rows = table.to_pyarrow_table().to_pylist()
            have = {r["key"]: (r["lsn"], json.loads(r["doc"])) for r in rows}
            want = {
                k: v
                for k, v in fold(
                    [
                        (first, [{**e, "collection": "orders"} for e in evs])
                        for first, evs in acked[c]
                    ]
                ).items()
            }
            assert have == want, (c, sorted(set(want.items()) ^ set(have.items()), key=str)[:5])
    finally:
        daemon.stop()
        weed.stop()
