"""The lease store on disk (daemon/table/lease.py, ``LocalStore``): S3's
conditional writes over a folder, which a shared table's maintenance lease
uses on disk (daemon/table/maintainer.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.table.lease import Holder, Lease, LeaseHeldError, LocalStore, PreconditionFailed
from tests.spark.test_crash import REPO

pytestmark = pytest.mark.timeout(120)


def test_a_create_only_write_of_an_existing_key_and_a_stale_etag_are_refused(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "_eventplane")
    first = store.put("maintainer.json", b"one", if_none_match=True)
    assert store.get("maintainer.json") == (b"one", first)
    with pytest.raises(PreconditionFailed):
        store.put("maintainer.json", b"two", if_none_match=True)
    second = store.put("maintainer.json", b"two", if_match=first)
    assert second != first and store.get("maintainer.json") == (b"two", second)
    with pytest.raises(PreconditionFailed):
        store.put("maintainer.json", b"three", if_match=first)
    store.delete("maintainer.json")
    assert store.get("maintainer.json") is None
    with pytest.raises(PreconditionFailed):  # gone: an If-Match fails, as on S3
        store.put("maintainer.json", b"three", if_match=second)
    again = store.put("maintainer.json", b"again", if_none_match=True)
    with pytest.raises(PreconditionFailed):  # the key of before: its ETag does not match
        store.put("maintainer.json", b"four", if_match=second)
    assert store.get("maintainer.json") == (b"again", again)
    assert sorted(p.name for p in (tmp_path / "_eventplane").iterdir()) == [
        "maintainer.json",
        "maintainer.json.lock",
    ]


TAKE = """
import sys, time
from pathlib import Path
from daemon.table.lease import Holder, Lease, LeaseHeldError, LocalStore
lease = Lease(LocalStore(Path(sys.argv[1])), "lease.json",
    Holder("host", 1000 + int(sys.argv[2]), "/d" + sys.argv[2], "wal-" + sys.argv[2], "s"))
while time.time() < float(sys.argv[3]):
    pass
try:
    lease.take()
    print("took")
except LeaseHeldError:
    print("refused")
"""


def test_processes_taking_one_lease_on_disk_at_once_leave_exactly_one_holder(
    tmp_path: Path,
) -> None:
    """Six processes take the lease at the same instant: one takes it, five are refused."""
    import time

    start = str(time.time() + 2.0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TAKE, str(tmp_path), str(i), start],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outs == ["refused"] * 5 + ["took"]


def test_a_lease_on_disk_is_refused_until_it_expires_then_taken(tmp_path: Path) -> None:
    now = [1_800_000_000.0]
    store = LocalStore(tmp_path)

    def lease(n: int) -> Lease:
        holder = Holder("host", 1000 + n, f"/d{n}", f"wal-{n}", "s")
        return Lease(store, "lease.json", holder, ttl_s=4, skew_s=1, clock=lambda: now[0])

    one, two = lease(1), lease(2)
    one.take()
    now[0] += 4.5  # past the ttl, within the skew
    with pytest.raises(LeaseHeldError, match="held by host pid 1001"):
        two.take()
    now[0] += 1.0
    two.take()
    assert two.holding
