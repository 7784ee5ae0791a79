"""The table lease (daemon/table/lease.py) on a real S3 server: one writer at
a time, a stalled writer fenced before another takes over, a restarted daemon
taking its own lease back at once. Time is a test clock, moved by hand."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from daemon.table.lease import (
    Holder,
    Lease,
    LeaseError,
    LeaseHeldError,
    S3Store,
    break_lease,
)
from tests.s3.server import S3Server

pytestmark = pytest.mark.timeout(180)


class Clock:
    """Wall and monotonic time, the same for every lease of a test."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def wall(self) -> float:
        return self.now

    def mono(self) -> float:
        return self.now - 1_700_000_000.0


class Leases:
    """Leases of one key on the server, sharing one test clock."""

    def __init__(self, s3_server: S3Server) -> None:
        self.store = S3Store(s3_server.client(), s3_server.bucket)
        self.key = f"lease-tests/{uuid.uuid4().hex}/_eventplane/lease.json"
        self.clock = Clock()

    def new(self, data_dir: str = "/var/lib/a", pid: int = 4242) -> Lease:
        holder = Holder("host-1", pid, data_dir, "wal-1", "orders")
        clock = self.clock
        return Lease(
            self.store, self.key, holder, ttl_s=30, skew_s=5, clock=clock.wall, monotonic=clock.mono
        )


@pytest.fixture
def leases(s3_server: S3Server) -> Leases:
    return Leases(s3_server)


def test_a_second_writer_is_refused_with_the_holders_name(leases: Leases) -> None:
    first, second = leases.new(), leases.new(data_dir="/var/lib/b")
    first.take()
    assert first.may_commit()
    with pytest.raises(LeaseHeldError, match=r"held by host-1 pid 4242 \(data_dir /var/lib/a"):
        second.take()
    assert not second.may_commit()


def test_a_writer_that_cannot_renew_stops_committing_before_another_takes_over(
    leases: Leases,
) -> None:
    """1. A takes the lease at t=0 and renews at t=8 (every (30-5)/3 s).
    2. A stalls: at t=8+25 its deadline passes, it may not commit.
    3. B is refused until t=8+30+5, then takes the lease over.
    4. A wakes up: its renewal fails (412), it still may not commit."""
    clock = leases.clock
    a, b = leases.new(), leases.new(data_dir="/var/lib/b")
    a.take()
    clock.now += a.renew_s
    a.renew()
    clock.now += 25 - 0.1
    assert a.may_commit()
    clock.now += 0.2
    assert not a.may_commit()  # fenced before the lease expires for others
    with pytest.raises(LeaseHeldError):
        b.take()
    clock.now += 10
    b.take()
    assert b.may_commit()
    with pytest.raises(LeaseError, match="taken over"):
        a.renew()
    assert not a.may_commit()


def test_the_same_daemon_restarted_takes_its_lease_back_at_once(leases: Leases) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    before = leases.new(pid=int(dead.stdout))
    before.take()
    after = leases.new()
    after.take()  # same host, data_dir and WAL; the old pid is gone
    assert after.may_commit()
    # Another daemon still waits.
    with pytest.raises(LeaseHeldError):
        leases.new(data_dir="/var/lib/b").take()


def test_release_and_break_remove_the_lease(leases: Leases) -> None:
    store, key = leases.store, leases.key
    a = leases.new()
    a.take()
    a.release()
    assert store.get(key) is None and not a.may_commit()
    b = leases.new(data_dir="/var/lib/b")
    b.take()
    assert break_lease(store, key) == b.holder
    assert store.get(key) is None
    assert break_lease(store, key) is None


def test_a_ttl_without_room_for_the_skew_is_refused(leases: Leases) -> None:
    with pytest.raises(ValueError, match="must exceed twice skew_s"):
        Lease(leases.store, "k", Holder("h", 1, "/d", "w", "s"), ttl_s=10, skew_s=5)


def test_a_renewal_whose_answer_was_lost_is_still_the_writers_own_lease(
    leases: Leases,
) -> None:
    """1. A takes the lease; its next renewal's PUT lands but the answer is
       lost (the store raises after the real write).
    2. A's next renewal (If-Match on the old ETag) gets 412, reads the lease,
       finds its own session: renewed, still A's.
    3. A's next take(), after another lost answer, takes its own lease back
       at once (it does not wait for it to expire)."""
    from unittest import mock

    store, clock = leases.store, leases.clock
    a = leases.new()
    a.take()
    real_put = S3Store.put

    def put_then_lose_answer(self: S3Store, *args: object, **kwargs: object) -> str:
        real_put(self, *args, **kwargs)  # type: ignore[arg-type]
        raise ConnectionError("the answer was lost")

    with mock.patch.object(S3Store, "put", put_then_lose_answer), pytest.raises(ConnectionError):
        a.renew()
    clock.now += a.renew_s
    a.renew()
    assert a.may_commit() and a.seconds_left() == pytest.approx(25)
    with mock.patch.object(S3Store, "put", put_then_lose_answer), pytest.raises(ConnectionError):
        a.renew()
    a.forget()  # as after a failed renewal the Keeper gave up on
    a.take()
    assert a.may_commit()
    # Another daemon is still refused: the lease is A's.
    with pytest.raises(LeaseHeldError):
        leases.new(data_dir="/var/lib/b").take()
    assert store.get(leases.key) is not None
