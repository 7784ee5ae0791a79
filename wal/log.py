"""The write-ahead log: group-commit writer thread, recovery on open, readers, retention.

Threads and ownership:

- the **writer thread** owns the active segment's file descriptor, assigns
  LSNs and per-core sequences, writes one frame per group and fdatasyncs it;
- the **event loop** calls :meth:`Wal.append` and runs the listener;
- **readers** (any thread) open their own descriptors and only trust bytes
  below a segment's published durable ``end``.

Publication order in the writer (what readers rely on): frame bytes written and
synced -> frame index appended -> ``segment.end`` -> ``head``. A reader that
sees ``head >= x`` therefore finds LSN ``x`` below the ``end`` it reads next.

Failures: a group whose *write* finds no space (ENOSPC, EDQUOT) is rolled back
and its appends get :class:`WalFullError`; the WAL goes on. A failed fsync
(any errno) and every other write error are fatal (invariant 10). See
:meth:`Wal._roll_back` and docs/wal.md, "A full volume".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
import time
import uuid
from array import array
from bisect import bisect_right
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import structlog

from wal.errors import (
    BelowRetainedFloorError,
    WalClosedError,
    WalCorruptionError,
    WalFatalError,
    WalFullError,
    WalReadError,
)
from wal.files import (
    IDENTITY,
    OutOfSpace,
    create_segment,
    cut_torn_tail,
    fsync_dir,
    lock_directory,
    read_identity,
    write_identity,
)
from wal.format import (
    FRAME_HEADER_SIZE,
    MAX_FRAME_BYTES,
    SECTION_HEADER_SIZE,
    SEGMENT_HEADER_SIZE,
    CoreSections,
    RequestEntry,
    RequestTag,
    encode_request_table,
    encode_sections,
    sections_of,
)
from wal.group import (
    _check_sections,
    _free_bytes,
    _merge,
    _pwrite_all,
    _restamp,
    _section_batches,
    _Waiter,
)
from wal.reader import (
    ReadBuf,
    ReadIterator,
    RecordBatch,
    frame_batches,
    frame_records,
    segment_frames,
)
from wal.record import Record
from wal.requests import RequestWindow, check_tag, load_snapshot, save_snapshot
from wal.segments import Segment, scan, segment_files


def _log() -> Any:
    """The ``wal`` logger, looked up per call (rare events only), so a logger cached
    before ``structlog.testing.capture_logs`` cannot hide events from tests."""
    return structlog.get_logger("wal")


MiB: Final = 1024 * 1024
FsyncMode = Literal["always", "interval", "never"]
Listener = Callable[[list[Record]], None]
# The columnar listener: one RecordBatch per core of the group, cores ascending.
BatchListener = Callable[[list[RecordBatch]], None]
GroupObserver = Callable[[int, int, float], None]
MIN_SEGMENT_BYTES: Final = 4096  # tests rotate tiny segments; the config asks for >= 1 MiB
_core_of = itemgetter(0)
_payload_of = itemgetter(1)
T = TypeVar("T")


def _raw_frame(
    buf: ReadBuf, frame: Any, core: int | None, lo: int, hi: int
) -> tuple[tuple[int, int, bytes]]:
    return ((frame.first_lsn, frame.events, bytes(buf[frame.offset : frame.offset + frame.size])),)


class Wal:
    """Segmented, checksummed write-ahead log with group commit. See docs/wal.md.

    Open with :meth:`Wal.open`; the constructor is internal.
    """

    on_group: GroupObserver | None

    def __init__(
        self,
        directory: Path,
        wal_id: bytes,
        segments: list[Segment],
        lock_fd: int,
        *,
        segment_bytes: int,
        fsync: FsyncMode,
        fsync_interval_ms: int,
        max_group_bytes: int,
        requests: RequestWindow,
    ) -> None:
        self.directory = directory
        self.wal_id = wal_id.hex()
        self._wal_id_bytes = wal_id
        self._segments = segments  # copy-on-write: replaced, never mutated, under _seg_lock
        self._seg_lock = threading.Lock()
        self._truncate_lock = threading.Lock()  # one retention pass at a time
        self._lock_fd = lock_fd
        self._segment_bytes = segment_bytes
        self._fsync: FsyncMode = fsync
        self._fsync_interval = fsync_interval_ms / 1000.0
        self._max_group_bytes = max_group_bytes
        self._requests = requests
        active = segments[-1]
        self._head = active.next_lsn - 1
        self._fd = os.open(active.path, os.O_WRONLY)
        self._next_seq: dict[int, int] = {}  # core -> next sequence; restarts with the process
        self._cond = threading.Condition(threading.Lock())
        self._pending: list[_Waiter] = []
        self._closing = False
        self._closed = False
        self._fatal: BaseException | None = None
        self._dirty = False  # written but not fdatasynced (fsync = interval | never)
        self._last_sync = time.monotonic()
        self._listener: Listener | BatchListener | None = None
        self._listen_batches = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_group = None
        self._thread = threading.Thread(target=self._writer_main, name="wal-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ open

    @classmethod
    def open(
        cls,
        directory: Path,
        *,
        segment_bytes: int = 64 * MiB,
        fsync: FsyncMode = "always",
        fsync_interval_ms: int = 100,
        max_group_bytes: int = 8 * MiB,
        holder: Mapping[str, str] | None = None,
        request_window_s: float = 0.0,
        request_max_keys: int = 0,
    ) -> Wal:
        """Open (or create) the WAL in ``directory`` and recover it.

        ``request_window_s`` and ``request_max_keys`` bound the de-duplication
        window of :meth:`find_request` (``wal/requests.py``); 0 keeps no keys.

        ``holder`` goes into the lock file beside the pid, host and time
        (the daemon passes its ``data_dir`` and config path), so that a second
        open, refused with :class:`WalLockedError`, can name this one.

        1. Create the directory if needed and take its lock.
        2. Read IDENTITY, or create a new WAL (segment 1, then IDENTITY).
        3. Scan every segment: headers, order, frames, CRCs.
        4. Cut a torn tail of the last segment (bytes saved as ``.broken``);
           refuse any other damage with :class:`WalCorruptionError`.
        5. Rebuild the de-duplication window: the ``REQUESTS`` snapshot, then
           the request tables of the retained frames, in LSN order.
        6. Start the writer thread on the last segment.
        """
        if segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be >= {MIN_SEGMENT_BYTES}, got {segment_bytes}")
        if fsync not in ("always", "interval", "never"):
            raise ValueError(f"fsync must be 'always', 'interval' or 'never', got {fsync!r}")
        if fsync_interval_ms <= 0 or max_group_bytes <= 0:
            raise ValueError("fsync_interval_ms and max_group_bytes must be positive")
        directory = Path(directory)
        # Step 1. Directory and lock.
        created = not directory.exists()
        directory.mkdir(parents=True, exist_ok=True)
        if created:
            fsync_dir(directory.parent)
        lock_fd = lock_directory(directory, holder)
        try:
            # Step 2. Identity.
            wal_id = read_identity(directory)
            if wal_id is None:
                wal_id = cls._create(directory)
            # Steps 3-5. Scan, recover, rebuild the window.
            window = RequestWindow(request_window_s, request_max_keys)
            window.add(load_snapshot(directory, wal_id))
            segments = cls._recover(directory, wal_id, window)
            return cls(
                directory,
                wal_id,
                segments,
                lock_fd,
                segment_bytes=segment_bytes,
                fsync=fsync,
                fsync_interval_ms=fsync_interval_ms,
                max_group_bytes=max_group_bytes,
                requests=window,
            )
        except BaseException:
            os.close(lock_fd)
            raise

    @staticmethod
    def _create(directory: Path) -> bytes:
        """New WAL: segment 1 first, IDENTITY last, so IDENTITY means "creation finished"."""
        leftovers = segment_files(directory)
        if any(p.stat().st_size > SEGMENT_HEADER_SIZE for p in leftovers):
            names = ", ".join(p.name for p in leftovers[:3])
            raise WalCorruptionError(
                f"segment files ({names}) but no IDENTITY file: restore IDENTITY or move the "
                "segments away",
                segment=IDENTITY,
                offset=0,
            )
        for path in leftovers:  # an interrupted creation: header-only files, no events
            path.unlink()
        wal_id = uuid.uuid4().bytes
        create_segment(directory, wal_id, 1, 1)
        write_identity(directory, wal_id)
        _log().info("wal.created", directory=str(directory), wal_id=wal_id.hex())
        return wal_id

    @staticmethod
    def _recover(directory: Path, wal_id: bytes, window: RequestWindow) -> list[Segment]:
        tables: list[list[RequestEntry]] = []
        result = scan(directory, wal_id, on_requests=tables.append)
        if result.strays:
            path, why = result.strays[0]
            raise WalCorruptionError(
                f"duplicated segment: {why}; run `eventplane wal repair` or move the copy away",
                segment=path.name,
                offset=0,
            )
        damage = result.damage
        if damage is not None and not damage.torn:
            raise WalCorruptionError(
                f"{damage.reason}. Refusing to open: this is not a torn tail, acknowledged "
                f"events may be affected (LSN {damage.next_lsn} onwards). "
                "Run `eventplane wal verify` for details and `eventplane wal repair` to cut the "
                "log at this point",
                segment=damage.segment,
                offset=damage.offset,
                length=damage.file_size - damage.offset,
            )
        if damage is not None:
            cut_torn_tail(directory, damage)
            if damage.whole_file:
                tables.clear()
                result = scan(directory, wal_id, on_requests=tables.append)
        segments = result.segments
        if not segments:
            raise WalCorruptionError(
                "IDENTITY exists but there is no segment file: the log was deleted",
                segment=IDENTITY,
                offset=0,
            )
        for seg in segments:
            seg.sealed = True
        segments[-1].sealed = False
        window.add(chain.from_iterable(tables))
        _log().info(
            "wal.opened",
            directory=str(directory),
            wal_id=wal_id.hex(),
            segments=len(segments),
            head_lsn=segments[-1].next_lsn - 1,
            floor_lsn=segments[0].first_lsn,
            request_keys=len(window),
        )
        for seg in segments:
            for first, last in seg.lost:
                _log().warning(
                    "wal.lost_range",
                    first_lsn=first,
                    last_lsn=last,
                    segment=seg.name,
                    message="these LSNs hold no event: tables committed them, the archive "
                    "never got them (a restore after a loss with ack = local)",
                )
        return segments

    # ------------------------------------------------------------------ state

    def head_lsn(self) -> int:
        """Last durable LSN (0 for an empty log). With fsync=interval|never: last written."""
        return self._head

    def retained_floor(self) -> int:
        """Lowest LSN still readable; ``head_lsn() + 1`` when nothing is retained."""
        head = self._head
        first = self._segments[0].first_lsn
        return min(first, head + 1)

    def lost_ranges(self) -> list[tuple[int, int]]:
        """The LSN ranges of the lost frames still retained (``wal.format.FLAG_LOST``:
        LSNs a restore found in tables but not in the archive); each holds no event."""
        return [r for seg in self._segments for r in seg.lost]

    def segment_count(self) -> int:
        return len(self._segments)

    def find_request(self, key: bytes) -> RequestEntry | None:
        """The durable append that carried ``key``, if it is in the de-duplication window.

        An append's key is here before that append returns (the writer adds
        it between the fdatasync and the hand-over), and after a restart once
        it was durable. Safe from any thread.
        """
        return self._requests.get(key)

    def request_keys(self) -> int:
        """How many keys the de-duplication window holds."""
        return len(self._requests)

    @property
    def fsync_mode(self) -> FsyncMode:
        return self._fsync

    def set_listener(self, fn: Listener | None) -> None:
        """``fn(records)`` runs on the event loop thread once per durable group, in LSN
        order, before that group's ``append()`` calls return.

        The loop is the one running here, else the one of the first ``append()``.
        Without a loop (only ``append_blocking``) it runs on the writer thread.
        """
        self._listener = fn
        self._listen_batches = False
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()

    def set_batch_listener(self, fn: BatchListener | None) -> None:
        """:meth:`set_listener`, columnar: ``fn(batches)`` gets one
        :class:`~wal.reader.RecordBatch` per core of the group (cores ascending,
        each in LSN order), the same events a record listener would get.

        The batches are the frame's sections as the writer encoded them (the
        section's joined payloads are the batch's ``data``): no object per
        event is made, which is what the daemon's rings take (``RingSet.push_batches``).
        """
        self._listener = fn
        self._listen_batches = True
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()

    # ------------------------------------------------------------------ append

    async def append(
        self, items: Sequence[tuple[int, bytes]], request: RequestTag | None = None
    ) -> tuple[int, int]:
        """Append ``(core, payload)`` items as one unit; ``(first_lsn, last_lsn)`` once durable.

        All items land in one frame: all durable or none. ``request`` (an
        idempotency key and a digest) is written in the same frame and is in
        :meth:`find_request` from before this call returns. Raises
        :class:`WalFullError` when the group's write found the volume full
        (nothing stored; the next call is tried as usual),
        :class:`WalFatalError` after any other write or any fsync failure (this
        call's or an earlier one's) and :class:`WalClosedError` once closing.
        """
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop.is_closed():
            self._loop = loop
        fut: asyncio.Future[tuple[int, int]] = loop.create_future()
        self._enqueue(items, fut, None, request)
        return await fut

    def append_blocking(
        self, items: Sequence[tuple[int, bytes]], request: RequestTag | None = None
    ) -> tuple[int, int]:
        """:meth:`append` for threads without an event loop (tools, subprocess tests)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                "append_blocking() from the listener on the writer thread would deadlock"
            )
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is self._loop and self._listener is not None:
                raise RuntimeError("append_blocking() on the listener's loop would deadlock")
        event = threading.Event()
        waiter = self._enqueue(items, None, event, request)
        event.wait()
        if waiter.error is not None:
            raise waiter.error
        assert waiter.result is not None
        return waiter.result

    def _enqueue(
        self,
        items: Sequence[tuple[int, bytes]],
        fut: asyncio.Future[tuple[int, int]] | None,
        event: threading.Event | None,
        request: RequestTag | None = None,
    ) -> _Waiter:
        if request is not None:
            check_tag(request)
        if isinstance(items, CoreSections):
            # Ingest's form: split by core already (no pass per event here).
            n, sections = items.n, items.sections
            _check_sections(n, sections)
        else:
            cores = list(map(_core_of, items))
            if not cores:
                raise ValueError("append() needs at least one (core, payload) item")
            payloads = list(map(_payload_of, items))
            try:
                array("I", cores)  # C-level range check: 0 <= core < 2**32
                lens = array("I", map(len, payloads))
            except (TypeError, OverflowError) as exc:
                raise ValueError(f"append(): cores must be ints in [0, 2**32): {exc}") from exc
            if set(map(type, payloads)) != {bytes}:
                raise TypeError("append(): payloads must be bytes")
            n, sections = len(cores), sections_of(cores, payloads, lens)
        waiter = _Waiter(n, sections, fut, event, request)
        if waiter.nbytes + FRAME_HEADER_SIZE + SECTION_HEADER_SIZE * n > MAX_FRAME_BYTES:
            raise ValueError(f"append(): {waiter.nbytes} bytes do not fit one frame (4 GiB)")
        with self._cond:
            if self._fatal is not None:
                raise WalFatalError(
                    f"the WAL refuses appends after a failed write or fsync: {self._fatal}"
                ) from self._fatal
            if self._closing:
                raise WalClosedError(f"the WAL in {self.directory} is closed")
            self._pending.append(waiter)
            self._cond.notify()
        return waiter

    # ------------------------------------------------------------------ writer thread

    def _writer_main(self) -> None:
        group: list[_Waiter] = []
        try:
            while True:
                taken = self._next_group()
                if taken is None:
                    break
                # Only ``group`` holds the waiters (and their payloads): it is
                # emptied after the commit, so nothing outlives it here.
                group, taken = taken, None
                if group:
                    self._commit(group)
                elif self._dirty:
                    self._sync()
                group = []
            if self._dirty and self._fsync == "interval":
                self._sync()
        except BaseException as exc:
            # Every failure that gets here is fatal; callers get it typed. (A
            # write that found no space never does: _commit rolls it back.)
            self._fail(exc, group)

    def _next_group(self) -> list[_Waiter] | None:
        """Wait for appends and take up to max_group_bytes of them.

        Returns [] when an interval fsync is due and None when closing.
        """
        with self._cond:
            while not self._pending:
                if self._closing:
                    return None
                if self._dirty and self._fsync == "interval":
                    remaining = self._last_sync + self._fsync_interval - time.monotonic()
                    if remaining <= 0:
                        return []
                    self._cond.wait(remaining)
                else:
                    self._cond.wait()
            pending = self._pending
            size = pending[0].nbytes
            take = 1
            while take < len(pending) and size + pending[take].nbytes <= self._max_group_bytes:
                size += pending[take].nbytes
                take += 1
            group = pending[:take]
            del pending[:take]
            return group

    def _commit(self, group: list[_Waiter]) -> None:
        """One group commit.

        1. Gather the group's events in LSN order (calls in arrival order).
        2. Encode one frame; rotate first if it would overflow the segment.
        3. Write it with one pwritev at the segment's end. No space for the
           segment or the frame: roll the group back and stop here.
        4. fdatasync (fsync = always; interval: when due).
        5. Publish: frame index, segment end, head; the request keys go into
           the de-duplication window.
        6. Hand over: listener, then the waiters' results (on the loop).

        Nothing is published before step 5: LSNs are ``head + 1`` onwards and
        the head moves only there, so a group that stops at step 3 leaves no
        LSN, index entry, listener call or ``on_group`` call behind.
        """
        # Step 1. Gather: each core's events of the group, in LSN order.
        sections = group[0].sections if len(group) == 1 else _merge(group)
        first = self._head + 1
        n = sum(w.n for w in group)
        tagged: list[tuple[int, int, RequestTag]] = []
        delta = 0
        for w in group:
            if w.request is not None:
                tagged.append((delta, w.n, w.request))
            delta += w.n
        written_ms = time.time_ns() // 1_000_000 if tagged else 0
        table = encode_request_table(written_ms, tagged) if tagged else b""
        # Step 2. Encode (and rotate).
        seg = self._segments[-1]
        frame = encode_sections(seg.number, first, n, sections, self._next_seq, table)
        offset = seg.end
        tried = frame.size
        try:
            if seg.next_lsn > seg.first_lsn and seg.end + frame.size > self._segment_bytes:
                tried += SEGMENT_HEADER_SIZE
                seg = self._rotate(seg)
                _restamp(frame.parts, seg.number)
                offset = seg.end
                tried = frame.size
            # Step 3. Write.
            _pwrite_all(self._fd, frame.parts, offset, frame.size)
        except OutOfSpace as exc:
            # Only the segment's creation and the frame's write raise this: the
            # seal's fdatasync in _rotate failing with ENOSPC is a plain OSError
            # and fatal, as is every fsync below.
            self._roll_back(group, frame.base_seqs, offset, tried, exc)
            return
        # Step 4. Sync.
        started = time.perf_counter()
        if self._fsync == "always":
            os.fdatasync(self._fd)
        else:
            self._dirty = True
            if (
                self._fsync == "interval"
                and time.monotonic() - self._last_sync >= self._fsync_interval
            ):
                self._sync()
        synced = time.perf_counter() - started
        # Step 5. Publish (order matters: see the module docstring).
        seg.frame_offsets.append(offset)
        seg.frame_lsns.append(first)
        seg.end = offset + frame.size
        seg.next_lsn = first + n
        self._head = first + n - 1
        if tagged:
            self._requests.add(
                RequestEntry(tag.key, tag.digest, first + d, first + d + k - 1, written_ms)
                for d, k, tag in tagged
            )
        # Step 6. Hand over.
        lsn = first
        for w in group:
            k = w.n
            w.result = (lsn, lsn + k - 1)
            lsn += k
        observer = self.on_group
        if observer is not None:
            try:
                observer(n, frame.size, synced)
            except Exception:
                _log().exception("wal.on_group_failed")
        listener = self._listener
        records: list[Record] | list[RecordBatch] | None = None
        if listener is not None:
            batches = _section_batches(first, frame)
            if self._listen_batches:
                records = batches
            else:  # tools and tests: Records in LSN order
                records = sorted(chain.from_iterable(b.records() for b in batches))
        self._deliver(records, group, first, n)

    def _deliver(
        self,
        records: list[Record] | list[RecordBatch] | None,
        group: list[_Waiter],
        first: int = 0,
        n: int = 0,
    ) -> None:
        loop = self._loop
        if records is not None and loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._finish, records, group, loop, first, n)
                return
            except RuntimeError:  # closed between the check and the call
                pass
        self._finish(records, group, None, first, n)

    def _finish(
        self,
        records: list[Record] | list[RecordBatch] | None,
        group: list[_Waiter],
        on_loop: asyncio.AbstractEventLoop | None,
        first: int = 0,
        n: int = 0,
    ) -> None:
        listener = self._listener
        if records is not None and listener is not None:
            try:
                listener(records)  # type: ignore[arg-type]  # the kind set_*listener chose
            except Exception:
                # The events are durable whatever the listener did: acknowledge
                # them. A consumer that missed them finds a gap and catches up
                # from the WAL (docs/design.md, consumer modes).
                _log().exception("wal.listener_failed", first_lsn=first, events=n)
        for w in group:
            w.settle(on_loop)

    def _roll_back(
        self,
        group: list[_Waiter],
        base_seqs: dict[int, int],
        offset: int,
        tried: int,
        exc: OutOfSpace,
    ) -> None:
        """Undo a group whose write found no space; fail its appends with WalFullError.

        Why this one failure is not fatal: nothing of the group was synced or
        acknowledged, and a failed *write* loses nothing already written (the
        page cache still holds every earlier byte). A failed *fsync* is another
        matter: the kernel may have dropped the dirty pages and marked them
        clean, so a retry could report success for data that is gone
        (PostgreSQL, 2018). Any fsync failure, ENOSPC included, stays fatal.

        1. Cut the active segment back to ``offset`` (where this group started:
           a partial frame may be on disk) and fdatasync the cut, so recovery
           never finds a torn frame and no later, acknowledged frame can sit
           before stale bytes of this one. With fsync = interval | never this
           also syncs the earlier written-but-unsynced groups; those were
           acknowledged already and are kept, only this group is undone.
           If rotation failed, the old segment ends at ``offset`` already and
           the partial new file is gone (create_segment); if the frame write
           failed in a new segment, that segment stays, empty and durable.
        2. Give back the per-core sequences the frame took. Its LSNs were
           never taken: they are ``head + 1`` onwards and the head did not
           move, so the next group gets the same LSNs and sequences.
        3. Fail every append of the group with its own WalFullError. Later
           appends are tried as usual: the WAL resumes once space returns.

        A failure in step 1 propagates and is fatal (invariant 10).
        """
        # Step 1. Cut and sync.
        os.ftruncate(self._fd, offset)
        self._sync()
        # Step 2. Sequences: encode_frame moved each core's from base to base + count.
        next_seq = self._next_seq
        for core, base in base_seqs.items():
            if base == 1:
                next_seq.pop(core, None)  # the core had no sequence yet (1 is never stored)
            else:
                next_seq[core] = base
        # Step 3. Fail the group, not the WAL.
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        reason = f"{name}: {exc.strerror}"
        free = _free_bytes(self.directory)
        for w in group:
            w.error = WalFullError(str(self.directory), tried, free, reason)
            w.error.__cause__ = cause
            w.settle(None)

    def _sync(self) -> None:
        os.fdatasync(self._fd)
        self._dirty = False
        self._last_sync = time.monotonic()

    def _rotate(self, seg: Segment) -> Segment:
        """Seal ``seg`` (synced whatever the fsync mode) and create the next segment."""
        if self._dirty:
            self._sync()
        new = create_segment(self.directory, self._wal_id_bytes, seg.number + 1, seg.next_lsn)
        fd = os.open(new.path, os.O_WRONLY)
        old_fd, self._fd = self._fd, fd
        os.close(old_fd)
        with self._seg_lock:
            seg.sealed = True
            self._segments = [*self._segments, new]
        _log().info(
            "wal.segment_rotated", sealed=seg.name, created=new.name, first_lsn=new.first_lsn
        )
        return new

    def _fail(self, exc: BaseException, group: list[_Waiter]) -> None:
        """Invariant 10: after a failed write or fsync nothing more is acknowledged.

        ``group`` is the group whose commit failed: its waiters were taken off
        ``_pending`` already and fail with everything still queued.
        """
        _log().error("wal.fatal", error=repr(exc), head_lsn=self._head, exc_info=exc)
        error = WalFatalError(
            f"WAL write or fsync failed ({exc!r}); the WAL refuses all further appends. "
            "Restart the daemon: recovery keeps every acknowledged event"
        )
        error.__cause__ = exc
        with self._cond:
            self._fatal = exc
            failed = [*group, *self._pending]
            self._pending = []
        for w in failed:
            w.error = error
            w.settle(None)

    # ------------------------------------------------------------------ read

    def read(
        self, from_lsn: int, *, core: int | None = None, to_lsn: int | None = None
    ) -> ReadIterator[Record]:
        """Durable records with ``from_lsn <= lsn <= to_lsn``, one core or all, in LSN order.

        Stops at the durable head as seen when it gets there. Raises
        :class:`BelowRetainedFloorError` (now) when ``from_lsn`` is below the
        retained floor and not above the head. Safe from any thread.
        """
        start = self._check_floor(from_lsn)
        return ReadIterator.over(self._scan(start, core, to_lsn, frame_records))

    def read_batches(
        self, from_lsn: int, *, core: int | None = None, to_lsn: int | None = None
    ) -> ReadIterator[RecordBatch]:
        """Like :meth:`read`, columnar: one :class:`RecordBatch` per frame and core.

        With ``core`` given, batches come in LSN order. For all cores, the
        batches of one frame come in core order, so LSNs of different cores
        interleave across them (each batch's ``lsns`` says where they go);
        use :meth:`read` when one global order is needed.
        """
        start = self._check_floor(from_lsn)
        return ReadIterator.over(self._scan(start, core, to_lsn, frame_batches))

    def read_frames(
        self, from_lsn: int, *, to_lsn: int | None = None, max_bytes: int = 1 << 62
    ) -> list[tuple[int, int, bytes]]:
        """Whole durable frames from the one holding ``from_lsn``: ``(first_lsn,
        events, frame bytes)`` each, exactly as written (CRC included), until
        ``to_lsn`` or about ``max_bytes`` (at least one frame). What the archive
        uploads (docs/wal.md, "The archive"). Same errors as :meth:`read`."""
        start = self._check_floor(from_lsn)
        out: list[tuple[int, int, bytes]] = []
        size = 0
        gen = self._scan(start, None, to_lsn, _raw_frame)
        try:
            for one in gen:
                for item in one:
                    out.append(item)
                    size += len(item[2])
                if size >= max_bytes:
                    break
        finally:
            gen.close()
        return out

    def _check_floor(self, from_lsn: int) -> int:
        start = max(from_lsn, 1)
        floor = self.retained_floor()
        if start < floor and start <= self._head:
            raise BelowRetainedFloorError(from_lsn, floor)
        return start

    def _scan(
        self,
        lsn: int,
        core: int | None,
        to_lsn: int | None,
        decode: Callable[[ReadBuf, Any, int | None, int, int], Iterable[T]],
    ) -> Generator[Iterable[T], None, None]:
        hi = to_lsn if to_lsn is not None else 1 << 63
        stalled = 0
        while lsn <= hi:
            head = self._head  # read before any segment's end: see the module docstring
            if lsn > head:
                return
            segments = self._segments
            i = bisect_right([s.first_lsn for s in segments], lsn) - 1
            if i < 0:
                raise BelowRetainedFloorError(lsn, self.retained_floor())
            seg = segments[i]
            sealed = seg.sealed  # read before end: a sealed segment's end is final
            end = seg.end
            progressed = False
            try:
                frames = segment_frames(seg, lsn, end, sealed)
                first_frame = next(frames, None)
            except FileNotFoundError as exc:
                floor = self.retained_floor()
                if lsn < floor:
                    raise BelowRetainedFloorError(lsn, floor) from exc
                raise WalReadError(f"{seg.name} vanished while LSN {lsn} was read") from exc
            if first_frame is not None:
                frames = chain((first_frame,), frames)
            for buf, frame in frames:
                last = frame.first_lsn + frame.events - 1
                if last < lsn:
                    continue
                # chain.from_iterable drains this before asking for the next
                # frame, so the buffer (an mmap) outlives every lazy decode.
                yield decode(buf, frame, core, lsn, hi)
                lsn = last + 1
                progressed = True
                if lsn > hi:
                    return
            # No progress once is a race with rotation (look again); twice is a bug.
            stalled = 0 if progressed else stalled + 1
            if stalled > 2:
                raise WalCorruptionError(
                    f"LSN {lsn} is durable (head {head}) but not found in the segment",
                    segment=seg.name,
                    offset=end,
                )

    # ------------------------------------------------------------------ retention

    def truncate_below(self, lsn: int) -> int:
        """Delete sealed segments whose every LSN is below ``lsn``; returns how many."""
        with self._truncate_lock:
            return self._truncate_below(lsn)

    def _truncate_below(self, lsn: int) -> int:
        # Only this method removes segments (under _truncate_lock); the writer
        # only appends to the list, so the prefix chosen here stays valid.
        segments = self._segments
        drop = 0
        # Never the active (last) segment; only a prefix, so the floor stays contiguous.
        while drop < len(segments) - 1 and segments[drop].last_lsn < lsn:
            drop += 1
        if not drop:
            return 0
        removed = segments[:drop]
        # Keys must outlive the segments that held them (wal/requests.py):
        # snapshot the window's entries below the new floor first.
        keep = self._requests.below(segments[drop].first_lsn)
        if keep:
            save_snapshot(self.directory, self._wal_id_bytes, keep)
        with self._seg_lock:
            self._segments = self._segments[drop:]
        for seg in removed:
            seg.path.unlink(missing_ok=True)
        fsync_dir(self.directory)
        _log().info(
            "wal.segments_removed",
            count=drop,
            below_lsn=lsn,
            floor_lsn=self.retained_floor(),
            first=removed[0].name,
            last=removed[-1].name,
        )
        return drop

    # ------------------------------------------------------------------ close

    def _begin_close(self) -> bool:
        with self._cond:
            if self._closing:
                return False
            self._closing = True
            self._cond.notify_all()
            return True

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)
        _log().info("wal.closed", directory=str(self.directory), head_lsn=self._head)

    async def aclose(self) -> None:
        """Flush pending appends, stop the writer thread, close the files."""
        self._begin_close()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)
        self._release()

    def close(self) -> None:
        """Synchronous :meth:`aclose`."""
        self._begin_close()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._release()

    def __enter__(self) -> Wal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Wal({str(self.directory)!r}, wal_id={self.wal_id}, head={self._head}, "
            f"segments={len(self._segments)}, fsync={self._fsync})"
        )
