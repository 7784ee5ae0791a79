"""One writer per table on object storage: a lease object next to the table.

The lease is a small JSON object (``<table>/_eventplane/lease.json`` in the
table's bucket) naming its holder (host, pid, data_dir, WAL id, stream) and
the wall-clock time it expires. Protocol:

1. **Take**: create it with ``If-None-Match: *``. It exists: if it is
   expired (past ``expires_at`` plus ``skew_s``), or it is this daemon's own
   from before a restart (same host, data_dir and WAL id, a pid that no
   longer runs), overwrite it with ``If-Match`` on its ETag; else refuse,
   naming the holder and when it expires.
2. **Renew** every ``renew_s``: overwrite with ``If-Match`` on the ETag of
   the last write. A 412 means another writer took it: the lease is lost.
3. **Fence**: the holder commits only while :meth:`Lease.may_commit`: before
   its own deadline, the last successful renewal's start (monotonic clock)
   plus ``ttl_s`` minus ``skew_s``. A daemon that cannot renew (the store is
   down, the network partitioned, the process stalled) stops committing
   before any other daemon may take the lease over. This deadline is a
   courtesy that saves work; what keeps a paused writer out is the new
   holder's fencing commit in the table's log (daemon/table/delta.py).
   A write whose answer was lost (the PUT landed, the client saw an error)
   is recognised by the ``session`` the body carries (one per
   :class:`Lease`): the lease is still this writer's.
4. **Release** on a clean stop: delete it if it is still ours. After a
   SIGKILL the next daemon waits until it expires (at most ``ttl_s`` plus
   ``skew_s``), or takes it at once if it is the same daemon restarted.

The store is an object with ``get(key)`` -> ``(body, etag)`` or None,
``put(key, body, if_none_match=False, if_match=None)`` -> etag (raising
:class:`PreconditionFailed` on a lost race) and ``delete(key)``:
:class:`S3Store` over boto3, :class:`LocalStore` over a folder on disk (a
shared table's maintenance lease, daemon/table/maintainer.py), or any test double.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from daemon.errors import DaemonError

# The wall clock leases are read and written by: this host's, plus a test's
# offset (tests/faults/test_takeover.py runs a standby whose clock runs ahead).
ENV_CLOCK_OFFSET = "EVENTPLANE_CLOCK_OFFSET_S"
_CLOCK_OFFSET_S = float(os.environ.get(ENV_CLOCK_OFFSET) or 0.0)


def wall_clock() -> float:
    """Unix time as leases see it (``time.time()`` unless a test skews it)."""
    return time.time() + _CLOCK_OFFSET_S


log = structlog.get_logger("eventplane.cdc")


class LeaseError(DaemonError):
    """The lease could not be taken or kept."""


class LeaseHeldError(LeaseError):
    """Another writer holds the table's lease."""


class TableTakenOverError(LeaseError):
    """Another writer committed to the table (its fence is in the log): this
    writer stops committing to it for good."""


class PreconditionFailed(Exception):
    """A conditional write lost its race (HTTP 412)."""


class Store(Protocol):
    def get(self, key: str) -> tuple[bytes, str] | None: ...

    def put(
        self, key: str, body: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str: ...

    def delete(self, key: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Holder:
    host: str
    pid: int
    data_dir: str
    wal_id: str
    stream: str

    @classmethod
    def this_process(cls, data_dir: str, wal_id: str, stream: str) -> Holder:
        return cls(socket.gethostname(), os.getpid(), data_dir, wal_id, stream)

    def same_daemon(self, other: Holder) -> bool:
        """The same daemon (host, data_dir, WAL id), maybe another process."""
        return (self.host, self.data_dir, self.wal_id) == (other.host, other.data_dir, other.wal_id)

    def __str__(self) -> str:
        return (
            f"{self.host} pid {self.pid} (data_dir {self.data_dir}, WAL {self.wal_id}, "
            f"stream {self.stream})"
        )


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """This daemon's lease on one table (module doc)."""

    def __init__(
        self,
        store: Store,
        key: str,
        holder: Holder,
        *,
        ttl_s: float = 30.0,
        skew_s: float = 5.0,
        clock: Callable[[], float] = wall_clock,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 2 * skew_s:
            raise ValueError(f"lease ttl_s ({ttl_s}) must exceed twice skew_s ({skew_s})")
        self.store, self.key, self.holder = store, key, holder
        self.ttl_s, self.skew_s = ttl_s, skew_s
        self._clock, self._monotonic = clock, monotonic
        self._etag: str | None = None
        self._deadline = float("-inf")  # monotonic: commits stop here
        # In each body: a write of this lease whose answer was lost is ours.
        self.session = uuid.uuid4().hex

    @property
    def renew_s(self) -> float:
        """How often to renew: three tries before the deadline."""
        return (self.ttl_s - self.skew_s) / 3

    def _body(self) -> bytes:
        now = self._clock()
        return json.dumps(
            {
                "holder": asdict(self.holder),
                "session": self.session,
                "renewed_at": now,
                "expires_at": now + self.ttl_s,
            },
            separators=(",", ":"),
            sort_keys=True,
        ).encode()

    def _write(self, *, if_none_match: bool = False, if_match: str | None = None) -> None:
        started = self._monotonic()
        self._etag = self.store.put(
            self.key, self._body(), if_none_match=if_none_match, if_match=if_match
        )
        self._deadline = started + self.ttl_s - self.skew_s

    def take(self) -> None:
        """Step 1. Raises :class:`LeaseHeldError` naming the holder."""
        try:
            self._write(if_none_match=True)
            return
        except PreconditionFailed:
            pass
        current = self.store.get(self.key)
        if current is None:  # released meanwhile: try once more from the start
            self._write(if_none_match=True)
            return
        body, etag = current
        raw = json.loads(body)
        if raw.get("session") == self.session:  # our own write, its answer lost
            self._write(if_match=etag)
            return
        other = Holder(**raw["holder"])
        expires_at = float(raw["expires_at"])
        expired = self._clock() > expires_at + self.skew_s
        restarted = other.same_daemon(self.holder) and not _pid_runs(other.pid)
        if not (expired or restarted):
            wait = expires_at + self.skew_s - self._clock()
            raise LeaseHeldError(
                f"{self.key}: held by {other}, for {wait:.0f} s more unless it renews. "
                f"One writer per table: stop that daemon, or wait until its lease expires."
            )
        try:
            self._write(if_match=etag)
        except PreconditionFailed as exc:
            raise LeaseHeldError(f"{self.key}: another writer took the lease first") from exc

    def renew(self) -> None:
        """Step 2. Raises :class:`LeaseError` when the lease was taken over;
        a store error propagates (the caller retries until the deadline)."""
        if self._etag is None:
            raise LeaseError(f"{self.key}: renew before take")
        try:
            self._write(if_match=self._etag)
            return
        except PreconditionFailed as exc:
            lost = exc
        # Our last write may have landed with its answer lost: its ETag is new.
        current = self.store.get(self.key)
        if current is not None and json.loads(current[0]).get("session") == self.session:
            self._write(if_match=current[1])
            return
        self.forget()
        raise LeaseError(f"{self.key}: the lease was taken over; stop committing") from lost

    @property
    def holding(self) -> bool:
        """Taken and not known lost (it may be past its deadline)."""
        return self._etag is not None

    def may_commit(self) -> bool:
        """Step 3: this daemon may commit to the table now."""
        return self._etag is not None and self._monotonic() < self._deadline

    def seconds_left(self) -> float:
        return max(0.0, self._deadline - self._monotonic())

    def forget(self) -> None:
        """The lease is not this writer's (taken over): no commit, no release."""
        self._etag, self._deadline = None, float("-inf")

    def release(self) -> None:
        """Step 4: remove the lease if it is still this daemon's."""
        etag, self._etag, self._deadline = self._etag, None, float("-inf")
        if etag is None:
            return
        current = self.store.get(self.key)
        if current is not None and current[1] == etag:
            self.store.delete(self.key)


def break_lease(store: Store, key: str) -> Holder | None:
    """Remove the lease whatever its state (an operator's decision); the holder it named."""
    current = store.get(key)
    if current is None:
        return None
    store.delete(key)
    return Holder(**json.loads(current[0])["holder"])


class S3Store:
    """:class:`Store` over a boto3 S3 client and one bucket."""

    def __init__(self, client: Any, bucket: str) -> None:
        self.client, self.bucket = client, bucket

    def get(self, key: str) -> tuple[bytes, str] | None:
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=key)
        except self.client.exceptions.NoSuchKey:
            return None
        return got["Body"].read(), str(got["ETag"])

    def put(
        self, key: str, body: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str:
        from botocore.exceptions import ClientError

        extra: dict[str, str] = {}
        if if_none_match:
            extra["IfNoneMatch"] = "*"
        if if_match is not None:
            extra["IfMatch"] = if_match
        try:
            put = self.client.put_object(Bucket=self.bucket, Key=key, Body=body, **extra)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            # 409: a conditional write racing another; 404 on If-Match: the
            # lease is gone (broken by hand), so it is no longer this writer's.
            if status in (409, 412) or (status == 404 and if_match is not None):
                raise PreconditionFailed(str(exc)) from exc
            raise
        return str(put["ETag"])

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)


class LocalStore:
    """:class:`Store` over a folder on disk (a shared table's ``_eventplane/``,
    maybe on NFS), with S3's conditional writes:

    - each key is one file, ``<key>``: its first line its ETag, the rest its body;
    - every call holds an exclusive flock on ``<key>.lock`` (never removed), so
      a read, compare and write is atomic among the daemons sharing the folder;
    - create-only (``if_none_match``): the file is written aside, fsynced and
      ``os.link``-ed to its name, which fails with EEXIST if it exists (even
      against a writer that does not lock): :class:`PreconditionFailed`;
    - ``if_match``: the current ETag is compared, then the file written aside
      replaces it (``os.replace``); a missing key fails as on S3;
    - an ETag is ``<counter>-<random>``: the counter goes up with each write of
      the key, the random part keeps a key deleted and created again from
      matching an ETag of before it.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        return self.root / key

    def _locked(self, key: str) -> int:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _read(self, key: str) -> tuple[bytes, str] | None:
        try:
            raw = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        etag, _, body = raw.partition(b"\n")
        return body, etag.decode()

    def get(self, key: str) -> tuple[bytes, str] | None:
        fd = self._locked(key)
        try:
            return self._read(key)
        finally:
            os.close(fd)

    def put(
        self, key: str, body: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str:
        from daemon.table.durable import fsync_dir

        fd = self._locked(key)
        try:
            current = self._read(key)
            if if_match is not None and (current is None or current[1] != if_match):
                raise PreconditionFailed(f"{self._path(key)}: its ETag is not {if_match}")
            counter = int(current[1].split("-", 1)[0]) + 1 if current is not None else 1
            etag = f"{counter}-{uuid.uuid4().hex[:12]}"
            path = self._path(key)
            aside = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
            with open(aside, "wb") as f:
                f.write(etag.encode() + b"\n" + body)
                f.flush()
                os.fsync(f.fileno())
            try:
                if if_none_match:
                    try:
                        os.link(aside, path)
                    except OSError as exc:
                        if exc.errno == errno.EEXIST:
                            raise PreconditionFailed(f"{path}: it exists") from None
                        raise
                else:
                    os.replace(aside, path)
            finally:
                aside.unlink(missing_ok=True)
            fsync_dir(path.parent)
            return etag
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        fd = self._locked(key)
        try:
            self._path(key).unlink(missing_ok=True)
        finally:
            os.close(fd)


class Keeper:
    """Keeps a :class:`Lease` for a table's writer: takes it, renews it in a
    thread of its own every ``renew_s``, and answers :meth:`check` before each
    commit (module doc, step 3). A lease taken over by another writer is taken
    again once it expires; until then :meth:`check` names the holder."""

    def __init__(self, lease: Lease, what: str) -> None:
        self.lease, self.what = lease, what
        self.error: str | None = None  # the last renewal's failure, for status
        self.taken_over: str | None = None  # set by surrender(): not ours any more
        self.renewals = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one store call at a time

    def start(self) -> None:
        """Take the lease (raises :class:`LeaseHeldError` naming the holder)
        and start renewing it."""
        with self._lock:
            self.lease.take()
        self._thread = threading.Thread(target=self._run, name=f"lease {self.what}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.lease.renew_s):
            self._refresh()

    def _refresh(self) -> None:
        try:
            with self._lock:
                if self.lease.holding:
                    self.lease.renew()
                else:
                    self.lease.take()
        except Exception as exc:
            if self.error is None:
                log.warning("lease_not_renewed", table=self.what, error=str(exc))
            self.error = str(exc)
            return
        if self.error is not None:
            log.info("lease_renewed_again", table=self.what)
        self.error = None
        self.renewals += 1

    def check(self) -> None:
        """Before a commit: the lease is this writer's until past the commit's
        start, or :class:`LeaseError` says why not (a renewal is tried first)."""
        if self.taken_over is not None:
            raise LeaseError(f"{self.what}: not committing: {self.taken_over}")
        if self.lease.may_commit():
            return
        self._refresh()
        if not self.lease.may_commit():
            raise LeaseError(
                f"{self.what}: not committing: this daemon does not hold the table's "
                f"lease ({self.error or 'expired'})"
            )

    def surrender(self, why: str) -> None:
        """Another writer took the table over (its fence is in the table's
        log): stop renewing and never take the lease again in this process;
        the lease is the new writer's, so it is left alone."""
        self.taken_over = why
        self._stop.set()
        with self._lock:
            self.lease.forget()

    def status(self) -> dict[str, Any]:
        return {
            "held": self.lease.may_commit(),
            "seconds_left": round(self.lease.seconds_left(), 1),
            "renewals": self.renewals,
            "error": self.error,
            "taken_over": self.taken_over,
        }

    def stop(self) -> None:
        """Stop renewing and release the lease (a failure is logged: the lease
        then expires by itself)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.lease.renew_s + 5)
        try:
            with self._lock:
                self.lease.release()
        except Exception as exc:
            log.warning("lease_not_released", table=self.what, error=str(exc))
