"""The WAL archived to object storage: uploader, manifest lease, fence (docs/wal.md, "The archive").

Under ``[wal.archive] uri = "s3://bucket/prefix"``:

- ``<prefix>/manifest.json`` is the archive's lease (:class:`ArchiveLease`, the
  table lease's protocol, daemon/table/lease.py): its holder (host, pid,
  data_dir, WAL id), the writer ``epoch``, the expiry; taken with a
  conditional create, renewed with ``If-Match`` every ``renew_s``.
- ``<prefix>/wal/<number>`` are the archive objects (wal/archive.py): whole
  WAL frames with their LSN range and checksums, created with
  ``If-None-Match: *`` at contiguous numbers. A *fence* object has no frames.

Start (:meth:`WalArchive.open`):

1. Read the manifest: a WAL id other than this data_dir's is refused, naming both.
2. Take the lease with the next epoch (refused while another daemon holds it).
3. List the objects; read the headers of the last ones.
4. Fence: create a fence object of the new epoch at each missing name among
   them, then at the next names until one is created (``F``), then at the
   :data:`MAX_IN_FLIGHT` - 1 names after it. An old holder has at most
   :data:`MAX_IN_FLIGHT` uploads open, all at names below ``F`` +
   :data:`MAX_IN_FLIGHT`, so its next one collides with a fence (or lands
   below ``F``, before the fence, where it counts). Objects above a fence with
   an older epoch are a paused writer's and never count.
5. The archived LSN is the end of the last object below ``F``; this WAL must
   hold everything after it.

Upload (:meth:`WalArchive._run`): with ``ack = "local"`` a group waits at most
``flush_ms``; with ``"archived"`` it goes as soon as one of the
:data:`MAX_IN_FLIGHT` upload slots is free. Then everything durable and
unarchived (up to :data:`MAX_OBJECT_BYTES`) becomes the next object. At most
:data:`MAX_IN_FLIGHT` are open at once (numbers ``done .. done +
MAX_IN_FLIGHT``); the archived LSN moves over the contiguous prefix that is
stored. A failed PUT is retried (backoff up to 5 s) until it
lands; a 412 whose object is not ours means a newer holder fenced us: the
archive stops for good, ingest answers 503 and health says why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import heapq
import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import structlog

from daemon import dlqcopy
from daemon.errors import ArchiveRefusedError, ArchiveUnavailable
from daemon.table.crash import crash_point
from daemon.table.lease import (
    Holder,
    Lease,
    LeaseError,
    LeaseHeldError,
    PreconditionFailed,
    S3Store,
    wall_clock,
)
from daemon.table.s3 import Location, client, explain
from triggers.store import store_path
from wal.archive import (
    OBJECT_HEADER_SIZE,
    ObjectHeader,
    encode_fence,
    encode_object,
    object_name,
    parse_header,
)
from wal.reader import RecordBatch

if TYPE_CHECKING:
    from daemon.config import S3Config, WalArchiveConfig
    from daemon.metrics import Metrics
    from wal import Wal

log = structlog.get_logger("eventplane.archive")

MAX_IN_FLIGHT: Final = 4  # archive objects uploading at once
MAX_OBJECT_BYTES: Final = 16 * 1024 * 1024  # frames per object, about (one frame may exceed it)
LOOK_BACK: Final = 2 * MAX_IN_FLIGHT  # objects whose headers a new holder reads
PRUNE_HEADERS: Final = 256  # headers of objects from before the start read per retention pass
RETRY_MAX_S: Final = 5.0
MANIFEST: Final = "manifest.json"
_T = TypeVar("_T")


class ArchiveLease(Lease):
    """The manifest: a :class:`Lease` whose body also carries the WAL id and the epoch."""

    def __init__(self, *args: Any, wal_id: str, epoch: int, uri: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.wal_id, self.epoch, self.uri = wal_id, epoch, uri

    _released = False

    def _body(self) -> bytes:
        body = json.loads(super()._body())
        body.update(wal_id=self.wal_id, epoch=self.epoch, uri=self.uri, format=1)
        if self._released:
            body.update(expires_at=body["renewed_at"], released=True)
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    def take(self) -> None:
        """:meth:`Lease.take`; a manifest released by a clean stop is taken at once."""
        current = self.store.get(self.key)
        if current is not None and json.loads(current[0]).get("released"):
            try:
                self._write(if_match=current[1])
                return
            except PreconditionFailed:
                pass  # another holder came first: the ordinary way decides
        super().take()

    def release(self) -> None:
        """A clean stop: the manifest stays (its epoch and WAL id are the
        archive's), marked expired, so the next holder takes it at once."""
        etag = self._etag
        if etag is None:
            return
        self._released = True
        try:
            self._write(if_match=etag)
        except PreconditionFailed:
            pass
        finally:
            self.forget()


def live_holder(manifest: dict[str, Any] | None, skew_s: float) -> str:
    """What a refused start adds when a primary holds the manifest now ("" if none)."""
    m = manifest or {}
    if m.get("released") or not m.get("holder"):
        return ""
    if wall_clock() > float(m.get("expires_at", 0)) + skew_s:
        return ""
    return (
        f"; its manifest is held now by {holder_text(m)}, the archive's primary: a second "
        "primary is refused while it lives (this machine as its standby: [wal.archive] role = "
        '"standby")'
    )


def holder_text(manifest: dict[str, Any]) -> str:
    """The manifest's holder as messages name it: host, pid, data_dir and epoch."""
    h = manifest.get("holder") or {}
    return (
        f"{h.get('host')} pid {h.get('pid')} (data_dir {h.get('data_dir')}), "
        f"epoch {manifest.get('epoch')}"
    )


class ManifestWatch:
    """A standby's view of the archive's manifest: who holds it, read at start
    and at the holder's renewal period after; it writes nothing
    (docs/operating.md, "A standby").

    The holder is the primary while its lease is live: not released by a clean
    stop, and not past ``expires_at + lease_skew_s`` by this host's clock (the
    rule a taker applies, daemon/table/lease.py).
    """

    def __init__(
        self,
        cfg: WalArchiveConfig,
        s3cfg: S3Config,
        *,
        s3: Any = None,
        clock: Callable[[], float] = wall_clock,
    ) -> None:
        self.cfg, self.s3cfg = cfg, s3cfg
        self.where = Location.parse(cfg.uri)
        self._s3 = s3
        self._clock = clock
        # The holder renews every (ttl - skew) / 3 (Lease.renew_s): read as often.
        self.interval_s = (s3cfg.lease_ttl_s - s3cfg.lease_skew_s) / 3
        self.manifest: dict[str, Any] | None = None
        self.read_at: float | None = None  # the last read that worked (Unix time)
        self.error: str | None = None  # the last read's error, until one works
        self.error_since: float | None = None
        self._task: asyncio.Task[None] | None = None

    def read(self) -> None:
        """One read of the manifest (any thread); an error is kept, not raised."""
        try:
            s3 = self._s3 = self._s3 if self._s3 is not None else client(self.s3cfg)
            try:
                got = s3.get_object(Bucket=self.where.bucket, Key=self.where.key(MANIFEST))
                manifest: dict[str, Any] | None = json.loads(got["Body"].read())
            except s3.exceptions.NoSuchKey:
                manifest = None
        except Exception as exc:
            why = f"cannot read {self.cfg.uri}/{MANIFEST}: {explain(exc, self.s3cfg, self.where)}"
            if self.error is None:
                log.warning("standby.manifest_unreadable", error=why)
                self.error_since = self._clock()
            self.error = why
            return
        if self.error is not None:
            log.info("standby.manifest_readable_again")
        self.error = self.error_since = None
        before = self.primary()
        self.manifest, self.read_at = manifest, self._clock()
        if self.primary() != before:
            log.info("standby.primary", primary=self.primary(), epoch=self.epoch())

    def live(self) -> bool:
        m = self.manifest
        if m is None or m.get("released") or not m.get("holder"):
            return False
        return self._clock() <= float(m.get("expires_at", 0)) + self.s3cfg.lease_skew_s

    def primary(self) -> str | None:
        """The host of the manifest's live holder; None when no daemon holds it."""
        if not self.live():
            return None
        assert self.manifest is not None
        host = (self.manifest.get("holder") or {}).get("host")
        return str(host) if host else None

    def epoch(self) -> int | None:
        return None if self.manifest is None else int(self.manifest.get("epoch", 0))

    def due_at(self) -> float | None:
        """When this standby takes over (Unix time by its clock), None while no
        WAL is archived: the holder's last renewal + ``lease_ttl_s`` +
        ``lease_skew_s`` (the rule a taker applies, daemon/table/lease.py). A
        manifest released by a clean stop waits as long, so a primary's restart
        keeps its role."""
        m = self.manifest
        if m is None or not m.get("wal_id") or not m.get("holder"):
            return None
        s3 = self.s3cfg
        if m.get("released"):
            return float(m.get("renewed_at", 0)) + s3.lease_ttl_s + s3.lease_skew_s
        return float(m.get("expires_at", 0)) + s3.lease_skew_s

    def takeover_due(self) -> bool:
        due = self.due_at()
        return due is not None and self.error is None and self._clock() > due

    def status(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "uri": self.cfg.uri,
            "primary": self.primary(),
            "holder": None if m is None else m.get("holder"),
            "held": self.live(),
            "epoch": self.epoch(),
            "wal_id": None if m is None else m.get("wal_id"),
            "takeover_in_s": None
            if self.due_at() is None
            else round(float(self.due_at() or 0) - self._clock(), 1),
            "manifest_read_s_ago": None
            if self.read_at is None
            else round(self._clock() - self.read_at, 1),
            "error": self.error,
        }

    def problem(self, stall_after_s: float) -> str | None:
        """What health reports (None: the manifest reads): the archive out of reach."""
        if self.error is None or self.error_since is None:
            return None
        failing = self._clock() - self.error_since
        if failing <= stall_after_s:
            return None
        return f"the standby has not read the archive's manifest for {failing:.0f} s: {self.error}"

    async def open(self) -> None:
        await asyncio.to_thread(self.read)
        log.info(
            "standby.opened",
            uri=self.cfg.uri,
            primary=self.primary(),
            epoch=self.epoch(),
            error=self.error,
        )

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="standby-manifest")

    async def _run(self) -> None:
        try:
            while True:
                # Read again at the holder's renewal period, and just after the
                # moment a takeover becomes due.
                wait = self.interval_s
                due = self.due_at()
                if due is not None:
                    wait = min(wait, max(due - self._clock(), 0.0) + 0.05)
                await asyncio.sleep(wait)
                await asyncio.to_thread(self.read)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("standby.watch_failed")
            raise ArchiveUnavailable(f"the standby's manifest watch failed: {exc}") from exc

    async def wait_failed(self) -> BaseException:
        """Return the watch's error once it fails (it does not end otherwise)."""
        assert self._task is not None
        try:
            await asyncio.shield(self._task)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return exc
        return ArchiveUnavailable("the standby's manifest watch stopped")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class _Object:
    __slots__ = ("done", "first", "last", "number")

    def __init__(self, number: int, first: int, last: int) -> None:
        self.number, self.first, self.last = number, first, last
        self.done = False


def _create(store: S3Store, key: str, body: bytes) -> None:
    crash_point("archive.before_put")
    store.put(key, body, if_none_match=True)


class WalArchive:
    """One daemon's archive of its WAL (module doc)."""

    def __init__(
        self,
        cfg: WalArchiveConfig,
        s3cfg: S3Config,
        wal: Wal,
        data_dir: str,
        metrics: Metrics,
        *,
        s3: Any = None,
    ) -> None:
        self.cfg, self.s3cfg, self.wal, self.metrics = cfg, s3cfg, wal, metrics
        self.data_dir = data_dir
        self.where = Location.parse(cfg.uri)
        self._s3 = s3
        self.store: S3Store | None = None
        self.lease: ArchiveLease | None = None
        self.acks_archived = cfg.ack == "archived"
        self.epoch = 0
        self.archived_lsn = 0  # every LSN up to here is in the archive
        self._cut_lsn = 0  # every LSN up to here is in an object made (uploading or stored)
        self._next = 0  # the next object's number
        self._open: deque[_Object] = deque()  # made, in number order, not all stored
        # (number, last LSN) of this process's stored data objects, for :meth:`prune`.
        self._stored: deque[tuple[int, int]] = deque()
        self._older: deque[int] = deque()  # numbers listed at the start, not yet pruned
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        # (last LSN, monotonic time, bytes) of each durable group not yet archived.
        self._groups: deque[tuple[int, float, int]] = deque()
        self._unarchived_bytes = 0
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()  # set whenever no object is uploading
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self.fenced: str | None = None
        self.outage: str | None = None  # the last upload's or renewal's error, until one works
        self.outage_since: float | None = None
        self.lease_error: str | None = None
        self.puts = 0
        self.fences_written = 0
        self.dlq_copied: tuple[int, float] | None = None  # (entries, when) of the last copy
        self._held: deque[tuple[int, Sequence[RecordBatch]]] = deque()
        self.forward: Callable[[Sequence[RecordBatch]], None] | None = None
        self._tasks: list[asyncio.Task[None]] = []  # the upload loop and the renewal
        self._uploads: set[asyncio.Task[None]] = set()  # open uploads, each removed when done
        self._key = self.where.key
        # Uploads, the renewal and the WAL reads of uploads: their own threads.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            MAX_IN_FLIGHT + 2, thread_name_prefix="wal-archive"
        )

    # ------------------------------------------------------------------ start

    async def _io(self, fn: Callable[..., _T], *args: Any, **kw: Any) -> _T:
        """``fn`` in the archive's own threads: S3 calls that wait on a store that
        is down never hold up the loop's default executor (WAL close, watermarks)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kw))

    def _object_key(self, number: int) -> str:
        return self._key(f"wal/{object_name(number)}")

    async def open(self) -> None:
        """Steps 1-5 of the module doc; raises :class:`ArchiveRefusedError`."""
        await self._io(self._open_sync)
        m = self.metrics
        m.archive_lsn.set(self.archived_lsn)
        m.archive_epoch.set(self.epoch)
        log.info(
            "archive.opened",
            uri=self.cfg.uri,
            epoch=self.epoch,
            archived_lsn=self.archived_lsn,
            next_object=self._next,
            ack=self.cfg.ack,
            wal_head_lsn=self.wal.head_lsn(),
        )

    def _open_sync(self) -> None:
        s3 = self._s3 if self._s3 is not None else client(self.s3cfg, self_checked=True)
        self._s3 = s3
        store = self.store = S3Store(s3, self.where.bucket)
        key = self._key(MANIFEST)
        wal_id = self.wal.wal_id
        try:
            current = store.get(key)
        except Exception as exc:
            raise ArchiveRefusedError(
                f"wal.archive: cannot read {self.cfg.uri}/{MANIFEST}: "
                f"{explain(exc, self.s3cfg, self.where)}"
            ) from exc
        epoch = 1
        if current is not None:
            raw = json.loads(current[0])
            theirs = str(raw.get("wal_id", ""))
            if theirs != wal_id:
                raise ArchiveRefusedError(
                    f"wal.archive: {self.cfg.uri} is the archive of WAL {theirs}, but the "
                    f"data_dir {self.data_dir} holds WAL {wal_id}: one archive per WAL. Point "
                    "[wal.archive] uri at a prefix of its own, or start from the data_dir of "
                    f"WAL {theirs}" + live_holder(raw, self.s3cfg.lease_skew_s)
                )
            epoch = int(raw.get("epoch", 0)) + 1
        self.epoch = epoch
        lease = self.lease = ArchiveLease(
            store,
            key,
            Holder.this_process(self.data_dir, wal_id, "wal-archive"),
            ttl_s=self.s3cfg.lease_ttl_s,
            skew_s=self.s3cfg.lease_skew_s,
            wal_id=wal_id,
            epoch=epoch,
            uri=self.cfg.uri,
        )
        try:
            lease.take()
        except LeaseHeldError as exc:
            raise ArchiveRefusedError(self._held_elsewhere(store, key, exc)) from exc
        self._fence(store, wal_id)

    def _held_elsewhere(self, store: S3Store, key: str, exc: LeaseHeldError) -> str:
        """Why a second primary may not start: the live holder, named."""
        try:
            got = store.get(key)
            raw = json.loads(got[0]) if got is not None else {}
        except Exception:
            raw = {}
        if not raw.get("holder"):
            return f"wal.archive: the archive's manifest {exc}"
        left = float(raw.get("expires_at", 0)) + self.s3cfg.lease_skew_s - wall_clock()
        return (
            f"wal.archive: {self.cfg.uri} has a primary already: its manifest is held by "
            f"{holder_text(raw)}, for {max(left, 0):.0f} s more unless it renews. One primary "
            "per archive: stop that daemon first (a clean stop hands the manifest over at "
            'once), or start this one as its standby ([wal.archive] role = "standby")'
        )

    def _list(self) -> list[int]:
        prefix = self._key("wal/")
        numbers: list[int] = []
        paginator = self._s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.where.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                name = item["Key"][len(prefix) :]
                if name.isdigit():
                    numbers.append(int(name))
        return sorted(numbers)

    def _header(self, number: int) -> ObjectHeader | None:
        try:
            got = self._s3.get_object(
                Bucket=self.where.bucket,
                Key=self._object_key(number),
                Range=f"bytes=0-{OBJECT_HEADER_SIZE - 1}",
            )
        except self._s3.exceptions.NoSuchKey:
            return None
        return parse_header(got["Body"].read())

    def _fence(self, store: S3Store, wal_id: str) -> None:
        """Steps 3-5: fences, then the archived LSN and the next number."""
        numbers = self._list()
        self._older = deque(numbers)  # for :meth:`_prune_older`
        top = numbers[-1] if numbers else 0
        low = max(numbers[0] if numbers else 1, top - LOOK_BACK + 1)
        present = set(numbers)
        heads: dict[int, ObjectHeader | None] = {
            k: self._header(k) for k in range(low, top + 1) if k in present
        }
        # What the archive holds as listed: the LSN each new fence records.
        floor = self.wal.retained_floor()
        self.archived_lsn = self._archived_of(heads, wal_id, floor)
        # Missing names among the last ones: an old holder's uploads still under way.
        for k in range(low, top + 1):
            if k not in present and not self._put_fence(store, wal_id, k):
                heads[k] = self._header(k)
        # The first fence above the top that this epoch creates (F), then the names
        # an old holder could still reach.
        n = max(top + 1, 1)
        while not self._put_fence(store, wal_id, n):
            heads[n] = self._header(n)
            n += 1
        fence = n
        archived = self._archived_of(heads, wal_id, floor)
        self.archived_lsn = archived
        for k in range(fence + 1, fence + MAX_IN_FLIGHT):
            self._put_fence(store, wal_id, k)
        head_lsn, floor = self.wal.head_lsn(), self.wal.retained_floor()
        if not numbers:
            # A new archive starts at the oldest event this WAL still holds.
            archived = self.archived_lsn = floor - 1
        if archived > head_lsn:
            raise ArchiveRefusedError(
                f"wal.archive: {self.cfg.uri} holds LSNs up to {archived}, but the WAL in "
                f"{self.data_dir} ends at LSN {head_lsn}: this WAL lost acknowledged events "
                "the archive has; it cannot continue the archive"
            )
        if archived + 1 < floor:
            raise ArchiveRefusedError(
                f"wal.archive: {self.cfg.uri} ends at LSN {archived}, but the WAL in "
                f"{self.data_dir} starts at LSN {floor}: LSNs {archived + 1}..{floor - 1} "
                "are in neither"
            )
        self._cut_lsn = archived
        self._next = fence + MAX_IN_FLIGHT
        if head_lsn > archived:
            nbytes = sum(self._backlog_bytes(archived + 1))
            self._groups.append((head_lsn, time.monotonic(), nbytes))
            self._unarchived_bytes = nbytes

    def _archived_of(self, heads: dict[int, ObjectHeader | None], wal_id: str, floor: int) -> int:
        """The last LSN of the objects that count: in number order, a fence masks
        the objects of older epochs after it (a paused writer's, never
        acknowledged), and the chain ends where LSNs from this WAL's retained
        ``floor`` on are in no object: an upload that never landed while a later
        one did (retention removes only LSNs below the floor). The objects
        after it never count (the fence at the missing name masks them); their
        LSNs are uploaded again."""
        archived = 0
        masked = 0
        started = False  # ``archived`` is an object's end, not the start value
        for k in sorted(heads):
            head = heads[k]
            if head is None:
                continue
            if head.wal_id != wal_id:
                raise ArchiveRefusedError(
                    f"wal.archive: object {object_name(k)} of {self.cfg.uri} is of WAL "
                    f"{head.wal_id}, this data_dir's is {wal_id}"
                )
            if head.fence:
                masked = max(masked, head.epoch)
                archived = max(archived, head.last_lsn)
                started = True
            elif head.epoch >= masked:
                if started and head.first_lsn > archived + 1 and archived + 1 >= floor:
                    break
                archived = head.last_lsn
                started = True
        return archived

    def _backlog_bytes(self, from_lsn: int) -> Iterator[int]:
        lsn = from_lsn
        head = self.wal.head_lsn()
        while lsn <= head:
            frames = self.wal.read_frames(lsn, max_bytes=MAX_OBJECT_BYTES)
            if not frames:
                return
            yield sum(len(f[2]) for f in frames)
            lsn = frames[-1][0] + frames[-1][1]

    def _put_fence(self, store: S3Store, wal_id: str, number: int) -> bool:
        archived = self.archived_lsn
        try:
            store.put(
                self._object_key(number),
                encode_fence(wal_id, self.epoch, number, archived),
                if_none_match=True,
            )
        except PreconditionFailed:
            return False
        self.fences_written += 1
        self.metrics.archive_puts.labels(result="fence").inc()
        log.info("archive.fence_written", object=object_name(number), epoch=self.epoch)
        return True

    # ------------------------------------------------------------------ run

    def start(self) -> None:
        """Start uploading and renewing. Set :attr:`forward` to the plane's WAL
        listener before ingest starts: it gets each group at once with
        ``ack = "local"``, once archived with ``"archived"``."""
        self._wake.set()
        self._tasks = [
            asyncio.create_task(self._run(), name="archive-upload"),
            asyncio.create_task(self._renew(), name="archive-lease"),
            asyncio.create_task(self._copy_dlq(), name="archive-dlq"),
        ]

    def on_durable_batches(self, batches: Sequence[RecordBatch]) -> None:
        """The WAL's batch listener (event loop): count the group, hand it on."""
        last = 0
        nbytes = 0
        for b in batches:
            if b.lsns:
                last = max(last, b.lsns[-1])
                nbytes += len(b.data) + 8 * len(b.lsns)
        if not last:
            return
        self._groups.append((last, time.monotonic(), nbytes))
        self._unarchived_bytes += nbytes
        self._wake.set()
        forward = self.forward
        if forward is None:
            return
        if self.acks_archived and last > self.archived_lsn:
            self._held.append((last, batches))
        else:
            forward(batches)

    async def _run(self) -> None:
        flush_s = self.cfg.flush_ms / 1000
        while self.fenced is None:
            if self.wal.head_lsn() <= self._cut_lsn:
                self._wake.clear()
                if self.wal.head_lsn() <= self._cut_lsn:
                    await self._wake.wait()
                continue
            # ack = "archived": the requests wait for the upload, so a group goes as
            # soon as an upload slot is free. "local": the oldest group not yet in an
            # object waits at most flush_ms, so objects are fewer and larger.
            if not self.acks_archived:
                oldest = next((t for last, t, _ in self._groups if last > self._cut_lsn), None)
                if oldest is not None:
                    wait = oldest + flush_s - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
            await self._slots.acquire()
            if self.fenced is not None:
                self._slots.release()
                return
            try:
                frames = await self._io(
                    self.wal.read_frames, self._cut_lsn + 1, max_bytes=MAX_OBJECT_BYTES
                )
            except Exception as exc:
                self._slots.release()
                log.error("archive.read_failed", error=str(exc), from_lsn=self._cut_lsn + 1)
                await asyncio.sleep(1.0)
                continue
            if not frames:
                self._slots.release()
                continue
            first = frames[0][0]
            last = frames[-1][0] + frames[-1][1] - 1
            obj = _Object(self._next, first, last)
            self._next += 1
            self._cut_lsn = last
            self._open.append(obj)
            self._drained.clear()
            parts = [f[2] for f in frames]
            body = b"".join(
                encode_object(self.wal.wal_id, self.epoch, obj.number, first, last, parts)
            )
            del parts
            del frames
            upload = asyncio.create_task(self._upload(obj, body))
            self._uploads.add(upload)
            upload.add_done_callback(self._uploads.discard)

    async def _upload(self, obj: _Object, body: bytes) -> None:
        """Create the object; retry until it lands, stop at a fence."""
        store = self.store
        assert store is not None
        key = self._object_key(obj.number)
        m = self.metrics
        backoff = 0.1
        while True:
            if self.fenced is not None:
                return
            started = time.perf_counter()
            try:
                await self._io(_create, store, key, body)
            except PreconditionFailed:
                if not await self._ours(key, body):
                    m.archive_puts.labels(result="fenced").inc()
                    await self._fenced_at(obj)
                    return
            except Exception as exc:
                m.archive_puts.labels(result="error").inc()
                self._set_outage(f"upload of {object_name(obj.number)} failed: {exc}")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            break
        m.archive_upload_latency.observe(time.perf_counter() - started)
        m.archive_puts.labels(result="ok").inc()
        m.archive_uploaded_bytes.inc(len(body))
        self.puts += 1
        obj.done = True
        self._clear_outage()
        self._advance()

    async def _ours(self, key: str, body: bytes) -> bool:
        """A 412 on our own retried create (its first answer lost): the object is this body."""
        store = self.store
        assert store is not None
        try:
            got = await self._io(store.get, key)
        except Exception:
            return False
        return got is not None and got[0] == body

    async def _holder(self) -> str:
        """The manifest's holder as messages name it ("another daemon" if unreadable)."""
        try:
            assert self.store is not None
            got = await self._io(self.store.get, self._key(MANIFEST))
            if got is not None:
                return holder_text(json.loads(got[0]))
        except Exception:
            pass
        return "another daemon"

    async def _fenced_at(self, obj: _Object) -> None:
        holder = await self._holder()
        self._fence_off(
            f"fenced: the create of archive object {object_name(obj.number)} (LSN "
            f"{obj.first}..{obj.last}) failed, that name is taken; the archive is held by "
            f"{holder}, this daemon's epoch is {self.epoch}. It acknowledges nothing more; "
            "stop it"
        )

    def _fence_off(self, why: str) -> None:
        if self.fenced is not None:
            return
        head = self.wal.head_lsn()
        if head > self.archived_lsn:
            # With ack = "local" these were acknowledged; the new holder has none of them.
            first = self.archived_lsn + 1
            log.error("archive.unarchived_after_fence", first_lsn=first, last_lsn=head)
            why += (
                f". LSN {first}..{head} are in this daemon's WAL only, never archived (with "
                'ack = "local" they were acknowledged): re-send those events from their source '
                "(eventplane wal inspect shows them)"
            )
        self.fenced = why
        self.metrics.archive_fenced.set(1)
        log.error("archive.fenced", reason=why, archived_lsn=self.archived_lsn)
        self._fail_waiters(ArchiveUnavailable(why, fenced=True))
        self._wake.set()
        if self.lease is not None:
            self.lease.forget()

    def _advance(self) -> None:
        """Move the archived LSN over the stored prefix; wake whoever waits for it."""
        moved = False
        while self._open and self._open[0].done:
            obj = self._open.popleft()
            self.archived_lsn = obj.last
            self._stored.append((obj.number, obj.last))
            self._slots.release()
            moved = True
        if not moved:
            return
        if not self._open:
            self._drained.set()
        archived = self.archived_lsn
        groups = self._groups
        while groups and groups[0][0] <= archived:
            self._unarchived_bytes -= groups.popleft()[2]
        if not groups:
            self._unarchived_bytes = 0
        self.metrics.archive_lsn.set(archived)
        waiters = self._waiters
        while waiters and waiters[0][0] <= archived:
            fut = heapq.heappop(waiters)[2]
            if not fut.done():
                fut.set_result(None)
        forward = self.forward
        held = self._held
        while held and held[0][0] <= archived:
            batches = held.popleft()[1]
            if forward is not None:
                forward(batches)

    def _set_outage(self, why: str) -> None:
        if self.outage is None:
            log.warning("archive.outage", error=why)
            self.outage_since = time.time()
        self.outage = why
        if self.acks_archived:
            self._fail_waiters(ArchiveUnavailable(f"the archive is unreachable: {why}"))

    def _clear_outage(self) -> None:
        if self.outage is not None:
            log.info("archive.resumed", outage_s=round(time.time() - (self.outage_since or 0), 3))
        self.outage = None
        self.outage_since = None

    def _fail_waiters(self, exc: ArchiveUnavailable) -> None:
        waiters, self._waiters = self._waiters, []
        for _, _, fut in waiters:
            if not fut.done():
                fut.set_exception(exc)

    async def _copy_dlq(self) -> None:
        """The DLQ's copy under the archive, while this daemon holds it (daemon/dlqcopy.py)."""
        path = store_path(self.data_dir)
        last: dlqcopy.Fingerprint | None = None
        pruned = False
        while self.fenced is None:
            await asyncio.sleep(dlqcopy.COPY_S)
            store = self.store
            if store is None or self.fenced is not None:
                continue
            try:
                got = await self._io(dlqcopy.read_dlq, path, last)
                if got is None or got[0] == last:
                    continue
                body = dlqcopy.encode(self.wal.wal_id, self.epoch, got[1])
                await self._io(store.put, self._key(dlqcopy.key_of(self.epoch)), body)
                last = got[0]
                self.dlq_copied = (len(got[1]), time.time())
                log.info("archive.dlq_copied", entries=len(got[1]), bytes=len(body))
                if not pruned:
                    older = await self._io(dlqcopy.epochs, store.client, self.where)
                    for epoch in older:
                        if epoch < self.epoch:
                            await self._io(store.delete, self._key(dlqcopy.key_of(epoch)))
                    pruned = True
            except Exception as exc:  # the next round tries again
                log.warning("archive.dlq_copy_failed", error=str(exc))

    async def _renew(self) -> None:
        lease = self.lease
        assert lease is not None
        while self.fenced is None:
            await asyncio.sleep(lease.renew_s)
            if self.fenced is not None:
                return
            try:
                await self._io(lease.renew)
            except LeaseError as exc:
                # Taken over: the new holder's fences would stop this daemon at
                # its next upload (what fences is the objects, not the lease); it
                # stops here already, so that nothing waits for that upload.
                self.lease_error = f"the archive's manifest was taken over: {exc}"
                log.error("archive.lease_lost", error=str(exc), epoch=self.epoch)
                holder = await self._holder()
                self._fence_off(
                    f"fenced: the archive's manifest was taken over; the archive is held by "
                    f"{holder}, this daemon's epoch is {self.epoch}. It acknowledges nothing "
                    "more; stop it"
                )
                return
            except Exception as exc:
                if self.lease_error is None:
                    log.warning("archive.lease_not_renewed", error=str(exc))
                self.lease_error = str(exc)
                continue
            if self.lease_error is not None:
                log.info("archive.lease_renewed_again")
            self.lease_error = None

    def prune(self, below_lsn: int) -> int:
        """Remove the data objects whose every LSN is below ``below_lsn``
        (every stage is done with them: the WAL's own retention rule), keeping
        the newest one; fences stay, they mask a paused writer's objects. Any
        thread; a failed DELETE is tried again at the next retention pass."""
        stored = self._stored
        removed = self._prune_older(below_lsn) if stored else 0
        while len(stored) > 1 and stored[0][1] < below_lsn:
            number = stored[0][0]
            try:
                self._s3.delete_object(Bucket=self.where.bucket, Key=self._object_key(number))
            except Exception as exc:
                log.warning("archive.prune_failed", object=object_name(number), error=str(exc))
                break
            stored.popleft()
            removed += 1
        if removed:
            log.info("archive.objects_removed", count=removed, below_lsn=below_lsn)
        return removed

    def _prune_older(self, below_lsn: int) -> int:
        """The objects listed at the start (an earlier process's, or a restored
        archive's), lowest number first while their every LSN is below
        ``below_lsn``: their headers are read as they come (at most
        :data:`PRUNE_HEADERS` a pass); fences stay. Called once this process
        has stored an object of its own, so the archive's end is never removed."""
        removed = 0
        older = self._older
        for _ in range(PRUNE_HEADERS):
            if not older:
                break
            number = older[0]
            try:
                head = self._header(number)
                if head is not None and not head.fence:
                    if head.last_lsn >= below_lsn:
                        break
                    self._s3.delete_object(Bucket=self.where.bucket, Key=self._object_key(number))
                    removed += 1
            except Exception as exc:
                log.warning("archive.prune_failed", object=object_name(number), error=str(exc))
                break
            older.popleft()
        return removed

    # ------------------------------------------------------------------ ingest

    def lease_refusal(self) -> str | None:
        """Why this daemon may acknowledge nothing now, in either mode (None: it
        may): fenced, or its manifest not renewed in time. It stops before its
        lease can end, as a table writer stops committing (invariant 18): a
        standby may take the archive over then (invariant 21)."""
        if self.fenced is not None:
            return self.fenced
        lease = self.lease
        if lease is not None and not lease.may_commit():
            window = self.s3cfg.lease_ttl_s - self.s3cfg.lease_skew_s
            return (
                "this daemon has not renewed the archive's manifest for over "
                f"s3.lease_ttl_s - s3.lease_skew_s ({window:g} s), so a standby may take "
                "over: it acknowledges nothing until a renewal lands "
                f"({self.lease_error or 'the store does not answer'})"
            )
        return None

    def refusal(self) -> str | None:
        """Why ingest answers 503 now (None: it may take the request)."""
        if self.fenced is not None:
            return self.fenced
        if (why := self.lease_refusal()) is not None:
            return f"{why}; nothing was stored"
        if self._unarchived_bytes > self.cfg.max_unarchived_bytes:
            return (
                f"{self._unarchived_bytes} bytes of the WAL are not archived yet, over "
                f"wal.archive.max_unarchived_bytes ({self.cfg.max_unarchived_bytes}); "
                f"nothing was stored; retry later ({self.outage or 'the archive is behind'})"
            )
        if self.acks_archived and self.outage is not None:
            return f"the archive is unreachable ({self.outage}); nothing was stored"
        return None

    async def until_archived(self, lsn: int) -> None:
        """Return once every LSN up to ``lsn`` is archived; raise :class:`ArchiveUnavailable`
        on an outage (the waiter is answered 503) or a fence."""
        if lsn <= self.archived_lsn:
            return
        if self.fenced is not None:
            raise ArchiveUnavailable(self.fenced, fenced=True)
        if self.outage is not None:
            raise ArchiveUnavailable(f"the archive is unreachable: {self.outage}")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (lsn, next(self._seq), fut))
        await fut

    # ------------------------------------------------------------------ status

    def unarchived_age_s(self) -> float:
        groups = self._groups
        return time.monotonic() - groups[0][1] if groups else 0.0

    def publish(self) -> None:
        m = self.metrics
        m.archive_unarchived_bytes.set(max(self._unarchived_bytes, 0))
        m.archive_unarchived_age.set(self.unarchived_age_s())

    def status(self) -> dict[str, Any]:
        lease = self.lease
        return {
            "uri": self.cfg.uri,
            "ack": self.cfg.ack,
            "epoch": self.epoch,
            "archived_lsn": self.archived_lsn,
            "unarchived_events": max(self.wal.head_lsn() - self.archived_lsn, 0),
            "unarchived_bytes": max(self._unarchived_bytes, 0),
            "unarchived_age_s": round(self.unarchived_age_s(), 3),
            "uploading": len(self._open),
            "next_object": object_name(self._next),
            "puts": self.puts,
            "dlq_copy": None
            if self.dlq_copied is None
            else {"entries": self.dlq_copied[0], "at": round(self.dlq_copied[1], 3)},
            "fenced": self.fenced,
            "outage": self.outage,
            "lease": None
            if lease is None
            else {
                "held": lease.may_commit(),
                "seconds_left": round(lease.seconds_left(), 1),
                "error": self.lease_error,
            },
        }

    def problem(self, stall_after_s: float) -> str | None:
        """What health reports about the archive (None: it keeps up)."""
        if self.fenced is not None:
            return self.fenced
        if self.lease is not None and not self.lease.holding:
            return self.lease_error or "the archive's manifest is not this daemon's"
        age = self.unarchived_age_s()
        if age > stall_after_s:
            why = self.outage or self.lease_error or "uploads are slow"
            return (
                f"the WAL archive is {age:.0f} s behind ({self._unarchived_bytes} bytes, LSN "
                f"{self.archived_lsn + 1} onwards not archived): {why}"
            )
        return None

    async def stop(self, timeout_s: float) -> None:
        """Let open uploads finish (within ``timeout_s``), stop, release the lease."""
        if self._open and self.fenced is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout_s)
        tasks = [*self._tasks, *self._uploads]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_waiters(ArchiveUnavailable("the daemon is stopping"))
        if self.lease is not None and self.fenced is None:
            try:
                await self._io(self.lease.release)
            except Exception as exc:
                log.warning("archive.lease_not_released", error=str(exc))
        # Queued calls go; one already in a thread ends with its client's timeout.
        self._pool.shutdown(wait=False, cancel_futures=True)


class ArchivedWal:
    """The WAL as the event plane sees it with an archive: segments go only once
    archived, and with ``ack = "archived"`` the stages read only archived events."""

    def __init__(self, wal: Wal, archive: WalArchive) -> None:
        self._wal, self._archive = wal, archive
        self.wal_id = wal.wal_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wal, name)

    def _cap(self) -> int:
        head = self._wal.head_lsn()
        return min(head, self._archive.archived_lsn) if self._archive.acks_archived else head

    def head_lsn(self) -> int:
        return self._cap()

    def read_batches(
        self, from_lsn: int, *, core: int | None = None, to_lsn: int | None = None
    ) -> Any:
        cap = self._cap()
        return self._wal.read_batches(
            from_lsn, core=core, to_lsn=cap if to_lsn is None else min(to_lsn, cap)
        )

    def read(self, from_lsn: int, *, core: int | None = None, to_lsn: int | None = None) -> Any:
        cap = self._cap()
        return self._wal.read(
            from_lsn, core=core, to_lsn=cap if to_lsn is None else min(to_lsn, cap)
        )

    def retained_floor(self) -> int:
        return self._wal.retained_floor()

    def truncate_below(self, lsn: int) -> int:
        """Only archived segments go (and, as ever, only below every reader);
        the archive's objects below every reader go too."""
        below = min(lsn, self._archive.archived_lsn + 1)
        removed = self._wal.truncate_below(below)
        self._archive.prune(below)
        return removed

    def truncate_below_keeping(self, lsn: int, archive_lsn: int) -> int:
        """:meth:`truncate_below`, but the archive keeps its objects from
        ``archive_lsn`` on: rows the trigger retry queue has yet to deliver,
        which a restore on a new disk evaluates again (invariant 9)."""
        below = min(lsn, self._archive.archived_lsn + 1)
        removed = self._wal.truncate_below(below)
        self._archive.prune(min(below, archive_lsn))
        return removed
