"""Compaction of CDC tables: a leaf partition's small files swapped for few large ones.

A reader lists folders, so a partition's files are replaced by swapping the
whole leaf folder (``renameat2(RENAME_EXCHANGE)``): a listing sees the old
folder or the new one, never both or neither (invariant 16). Work happens
under ``<path>/_eventplane/compact/`` (``c<C>.json`` intent, ``c<C>/out/``,
``c<C>/<partition>/``). Steps of compaction C of partition P
(:func:`run_compaction`; crash points ``cdc.compact.<name>``):

1. **Pick** (:mod:`daemon.table.compactplan`), then claim P under the commit lock.
2. **Write** the merged files under ``out/`` (:mod:`daemon.table.compactmerge`);
   row counts checked, fsynced (``after_write``).
3. **Intent** ``c<C>.json`` (``after_intent``).
4. **Build** ``c<C>/<partition>/``: the merged files plus hard links of P's
   other files (``mid_build``).
5. **Swap** under ``commit_lock``: the commit point (``before_swap``, ``after_swap``).
6. **Ledger**: the compaction recorded (``after_ledger``).
7. **Clean** the old folder, ``out/`` and the intent (``mid_clean``).

**Recovery** (:func:`recover`): an intent whose outputs are in P rolls
forward, one whose outputs are not rolls back, one whose P is gone is
cleaned. :class:`CompactionService` runs compactions in one background
thread. The why (readers across a swap, file systems, policy, memory):
docs/cdc.md, "Compaction".
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from daemon.table.compactmerge import write_merged
from daemon.table.compactplan import Plan, Progress, _own_compaction, file_counts, plan_stream
from daemon.table.crash import crash_point
from daemon.table.durable import atomic_write_json, fsync_dir, fsync_file
from daemon.table.errors import (
    CdcRecoveryError,
    CompactionError,
    CompactionUnsupportedError,
    PartitionGoneError,
)
from daemon.table.sink import MaintainedTable, RecoveryReport
from daemon.table.snapshot import table_change

log = structlog.get_logger("eventplane.cdc")

COMPACT_DIR = "compact"
RENAME_EXCHANGE = 1 << 1  # <linux/fs.h>
_AT_FDCWD = -100
_INTENT = re.compile(r"c(\d{12})\.json")
_WORK = re.compile(r"c(\d{12})")
_TASK = re.compile(r"^part-(\d{5})-")
# Spark scheduler pool of compaction jobs: with spark.scheduler.mode = FAIR they
# share the executors with the batches instead of going first (FIFO).
POOL = "eventplane-compaction"
# Backoff of a stream whose compaction failed: doubling from the interval, up to this.
MAX_BACKOFF_S = 3600.0


# --------------------------------------------------------------------------
# The atomic folder swap


_libc: Any = None


def exchange(a: Path, b: Path) -> None:
    """Swap the names ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        raise CompactionUnsupportedError(
            "compaction needs renameat2(RENAME_EXCHANGE) (Linux 3.15+, glibc 2.28+), "
            "which this system's C library does not have"
        )
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        raise CompactionUnsupportedError(
            f"the file system of {b} cannot swap two folders atomically "
            f"(renameat2 RENAME_EXCHANGE: {os.strerror(err)}); NFS and some others lack it. "
            f"Compaction is refused there and the table stays uncompacted: set "
            f"compaction = false on the stream, or move it to a local file system"
        )
    raise OSError(err, os.strerror(err), str(a), None, str(b))


_supported: dict[Path, str | None] = {}


def check_exchange(meta_compact: Path) -> None:
    """Try the swap once per folder on two empty folders; raise if unsupported."""
    known = _supported.get(meta_compact, "")
    if known is None:
        return
    if known:
        raise CompactionUnsupportedError(known)
    a = meta_compact / f".probe-a-{os.getpid()}"
    b = meta_compact / f".probe-b-{os.getpid()}"
    try:
        for d in (a, b):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        (a / "x").touch()
        exchange(a, b)
        if not (b / "x").exists():
            raise CompactionUnsupportedError(f"renameat2 RENAME_EXCHANGE did not swap {a} and {b}")
        _supported[meta_compact] = None
    except CompactionUnsupportedError as exc:
        _supported[meta_compact] = str(exc)
        raise
    finally:
        for d in (a, b):
            shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------
# One compaction


def _cdir(sink: MaintainedTable) -> Path:
    return sink.meta / COMPACT_DIR


def _intent(sink: MaintainedTable, cid: int) -> Path:
    return _cdir(sink) / f"c{cid:012d}.json"


def _work(sink: MaintainedTable, cid: int) -> Path:
    return _cdir(sink) / f"c{cid:012d}"


def _footer_rows(files: Iterable[Path]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(f).num_rows for f in files)


def _outputs(out: Path, plan: Plan, cid: int) -> list[tuple[str, str]]:
    """(staged name, final name) of the merged files, in task (bin) order."""
    pairs = []
    for n in sorted(os.listdir(out)):
        if n.startswith(("_", ".")):
            continue  # _SUCCESS, .crc checksums
        m = _TASK.match(n)
        if not m or int(m.group(1)) >= len(plan.bins):
            raise CompactionError(f"unexpected file {n} in the compaction's output {out}")
        b = plan.bins[int(m.group(1))]
        first, last = min(f.first for f in b), max(f.last for f in b)
        pairs.append((n, f"part-c{cid:012d}-b{first:012d}-b{last:012d}-{n[len('part-') :]}"))
    return pairs


def _sync_links(src: Path, dst: Path, skip: set[str], keep: set[str]) -> bool:
    """Make ``dst`` hold a hard link of every file of ``src`` not in ``skip``
    (same inode), and nothing else but ``keep``. True when it changed ``dst``."""
    want: dict[str, int] = {}
    with os.scandir(src) as it:
        for e in it:
            if e.name in skip or e.name.startswith("."):
                continue  # inputs; temp files of a writer
            if not e.is_file(follow_symlinks=False):
                raise CompactionError(
                    f"{src} holds {e.name}, which is not a file; compaction only "
                    f"merges partition folders of plain files"
                )
            want[e.name] = e.inode()
    have: dict[str, int] = {}
    with os.scandir(dst) as it:
        for e in it:
            have[e.name] = e.inode()
    changed = False
    for name, ino in want.items():
        if have.get(name) != ino:
            if name in have:
                (dst / name).unlink()
            os.link(src / name, dst / name)
            changed = True
    for name in have.keys() - want.keys() - keep:
        (dst / name).unlink()
        changed = True
    return changed


def run_compaction(
    sink: MaintainedTable, spark: Any, plan: Plan, progress: Progress, *, write: Any = None
) -> Progress:
    """Steps 2-7 of the module doc for one partition. Raises on failure, after
    rolling back what was not swapped; a failure after the swap rolls forward
    at the next :func:`recover`."""
    write = write or write_merged
    folder = sink.path / plan.partition
    cdir = _cdir(sink)
    cdir.mkdir(exist_ok=True)
    check_exchange(cdir)
    cid = sink.ledger.last_compaction_id + 1
    progress.id = cid
    work, intent = _work(sink, cid), _intent(sink, cid)
    out, new = work / "out", work / plan.partition
    shutil.rmtree(work, ignore_errors=True)  # a failed attempt's leftovers: never visible
    # Step 1 (end). Claim the leaf, under the commit lock: retention skips a
    # claimed leaf (retention.apply), so the folder swapped in step 5 is the
    # one planned, and a leaf retention removed since the plan is not touched.
    with sink.commit_lock:
        try:
            present = set(os.listdir(folder))
        except FileNotFoundError:
            present = set()
        if not {f.name for f in plan.inputs} <= present:
            raise PartitionGoneError(
                f"stream {sink.name!r} {plan.partition}: the partition or some of its "
                f"files went (retention) since the plan; not compacted"
            )
        sink.compacting.add(plan.partition)
    swapped = False
    try:
        # Step 2. Write: Spark merges exactly the inputs, where no reader looks.
        progress.step = "writing"
        work.mkdir()
        write(spark, folder, plan, out)
        crash_point("cdc.compact.after_write")
        outputs = _outputs(out, plan, cid)
        rows_in = _footer_rows(folder / f.name for f in plan.inputs)
        rows_out = _footer_rows(out / s for s, _ in outputs)
        if rows_in != rows_out:
            raise CompactionError(
                f"stream {sink.name!r} {plan.partition}: the merged files hold {rows_out} "
                f"rows, the inputs {rows_in}; nothing was changed"
            )
        for staged, _ in outputs:
            fsync_file(out / staged)
        progress.rows = rows_in
        progress.output_bytes = sum((out / s).stat().st_size for s, _ in outputs)
        progress.outputs = [final for _, final in outputs]
        # Step 3. Intent.
        record = {
            "id": cid,
            "partition": plan.partition,
            "mode": plan.mode,
            "inputs": len(plan.inputs),
            "input_bytes": plan.input_bytes,
            "outputs": progress.outputs,
            "output_bytes": progress.output_bytes,
            "rows": rows_in,
            "first_batch": progress.first_batch,
            "last_batch": progress.last_batch,
        }
        atomic_write_json(intent, {**record, "input_files": [f.name for f in plan.inputs]})
        crash_point("cdc.compact.after_intent")
        # Step 4. Build the new folder beside the live one (same relative path
        # under work/, on the table's file system: the swap cannot cross one).
        progress.step = "swapping"
        new.mkdir(parents=True)
        for i, (staged, final) in enumerate(outputs):
            os.rename(out / staged, new / final)
            if i == 0:
                crash_point("cdc.compact.mid_build")
        inputs = {f.name for f in plan.inputs}
        finals = set(progress.outputs)
        _sync_links(folder, new, inputs, finals)
        fsync_dir(new)
        # Step 5. Swap, under the commit lock: no file lands in the folder meanwhile.
        waited = time.monotonic()
        with sink.commit_lock:
            held = time.monotonic()
            progress.lock_wait_s = held - waited
            try:
                present = set(os.listdir(folder))
            except FileNotFoundError:  # claimed, so only an outside hand removes it
                present = set()
            if not inputs <= present:
                raise CompactionError(
                    f"stream {sink.name!r} {plan.partition}: inputs vanished during the "
                    f"compaction ({sorted(inputs - present)[:3]}); nothing was changed"
                )
            if _sync_links(folder, new, inputs, finals):
                fsync_dir(new)
            crash_point("cdc.compact.before_swap")
            with table_change(sink.path):  # snapshot readers list again (daemon/table/snapshot.py)
                exchange(new, folder)
                swapped = True
            progress.lock_held_s = time.monotonic() - held
        fsync_dir(folder.parent)  # the swap is durable before the ledger names it
        fsync_dir(new.parent)
        crash_point("cdc.compact.after_swap")
        # Step 6. Ledger (under the commit lock again, like a batch's ledger write).
        sink.record_compaction({**record, "at": time.time()})
        crash_point("cdc.compact.after_ledger")
        # Step 7. Clean: the old folder (now under work/), out/, the intent.
        progress.step = "cleaning"
        _clean(sink, cid, mid=True)
    except BaseException:
        if not swapped:
            _clean(sink, cid)
            _release(sink, plan.partition)
        # else: the leaf stays claimed until recover() rolls the intent forward.
        raise
    _release(sink, plan.partition)
    progress.step = "done"
    progress.finished_at = time.time()
    return progress


def _leaf(sink: MaintainedTable, partition: str) -> Path:
    """The folder of a leaf partition named in an intent; ValueError when the
    name is not one (absolute, ``..``, hidden, or not as deep as
    ``partition_by``): recovery must never delete or swap anything else."""
    parts = partition.split("/")
    if len(parts) != len(sink.stream.partition_by) or not all(
        p.startswith(f"{col}=") for p, col in zip(parts, sink.stream.partition_by, strict=True)
    ):
        raise ValueError(
            f"partition {partition!r} is not a leaf of partition_by = "
            f"{list(sink.stream.partition_by)}"
        )
    return sink.path.joinpath(*parts)


def _release(sink: MaintainedTable, partition: str) -> None:
    with sink.commit_lock:
        sink.compacting.discard(partition)


def _clean(sink: MaintainedTable, cid: int, *, mid: bool = False) -> None:
    shutil.rmtree(_work(sink, cid), ignore_errors=True)
    if mid:
        crash_point("cdc.compact.mid_clean")
    _intent(sink, cid).unlink(missing_ok=True)
    fsync_dir(_cdir(sink))


def recover(sink: MaintainedTable, report: RecoveryReport | None = None) -> RecoveryReport:
    """Finish or undo interrupted compactions (module doc, Recovery)."""
    report = report if report is not None else RecoveryReport()
    cdir = _cdir(sink)
    cdir.mkdir(exist_ok=True)
    intents: dict[int, Path] = {}
    works: set[int] = set()
    for p in cdir.iterdir():
        if p.name.startswith("."):  # temp files of atomic writes, exchange probes
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        elif m := _INTENT.fullmatch(p.name):
            intents[int(m.group(1))] = p
        elif m := _WORK.fullmatch(p.name):
            works.add(int(m.group(1)))
    for cid, file in sorted(intents.items()):
        try:
            raw = json.loads(file.read_bytes())
            partition = str(raw["partition"])
            folder = _leaf(sink, partition)
            outputs = [str(o) for o in raw["outputs"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CdcRecoveryError(
                f"stream {sink.name!r}: compaction intent {file} is unreadable ({exc}). "
                f"It was written atomically, so the disk or an operator changed it."
            ) from exc
        visible = sum((folder / o).exists() for o in outputs)
        if not folder.is_dir():
            # Retention removed the leaf since (`eventplane cdc retention --apply`
            # runs no compaction recovery): swapped or not, none of its rows
            # are visible any more, and nothing is put back.
            report.compactions_rolled_back.append(cid)
            log.warning(
                "cdc.compaction_rolled_back",
                stream=sink.name,
                id=cid,
                partition=partition,
                reason="partition removed",
            )
        elif outputs and visible == len(outputs):
            # Swapped: the merged files are the partition's. Roll forward.
            if cid > sink.ledger.last_compaction_id:
                record = {k: v for k, v in raw.items() if k != "input_files"}
                sink.record_compaction({**record, "at": time.time(), "recovered": True})
            report.compactions_rolled_forward.append(cid)
            log.warning("cdc.compaction_rolled_forward", stream=sink.name, id=cid)
        elif visible == 0:
            report.compactions_rolled_back.append(cid)
            log.warning("cdc.compaction_rolled_back", stream=sink.name, id=cid)
        else:
            raise CdcRecoveryError(
                f"stream {sink.name!r}: compaction {cid} has {visible} of its "
                f"{len(outputs)} merged files in {folder}; a folder swap is atomic, so "
                f"something else changed that folder. Inspect {file} and {folder}."
            )
        _clean(sink, cid)
        _release(sink, partition)
        works.discard(cid)
    for cid in sorted(works):
        shutil.rmtree(_work(sink, cid), ignore_errors=True)
        report.compactions_rolled_back.append(cid)
    return report


def compact_stream(
    sink: MaintainedTable,
    spark: Any,
    *,
    full: bool,
    on_progress: Callable[[Progress], None] | None = None,
    stop: threading.Event | None = None,
    done: list[Progress] | None = None,
) -> list[Progress]:
    """Every compaction the stream's policy asks for now, one partition at a time;
    the finished ones (also appended to ``done`` as they finish)."""
    own = _own_compaction(sink)
    if own is not None:
        progress = own(spark, full=full, on_progress=on_progress)
        done = [] if done is None else done
        if progress is not None:
            done.append(progress)
        return done
    recover(sink)  # an earlier attempt that failed after its swap rolls forward first
    done = [] if done is None else done
    for plan in plan_stream(sink, full=full):
        if stop is not None and stop.is_set():
            break
        progress = Progress.of(sink.name, plan)
        if on_progress is not None:
            on_progress(progress)
        log.info("cdc.compaction_started", stream=sink.name, **plan.to_json())
        try:
            run_compaction(sink, spark, plan, progress)
        except PartitionGoneError as exc:
            progress.step = "skipped"
            progress.error = str(exc)
            progress.finished_at = time.time()
            log.info("cdc.compaction_skipped", stream=sink.name, partition=plan.partition)
            continue
        except BaseException as exc:
            progress.step = "failed"
            progress.error = f"{type(exc).__name__}: {exc}"[:2000]
            progress.finished_at = time.time()
            raise
        log.info("cdc.compaction_done", stream=sink.name, **progress.to_json())
        done.append(progress)
    return done


# --------------------------------------------------------------------------
# The daemon's background compactions


@dataclass(slots=True)
class _StreamState:
    sink: MaintainedTable
    next_check: float
    running: Progress | None = None
    last: Progress | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    failures: int = 0  # in a row
    compactions: int = 0
    files_removed: int = 0
    files: dict[str, int] = field(default_factory=dict)  # partition -> data files
    scanned_at: float | None = None
    scanned_batch_id: int = 0  # the stream's last committed batch at that scan
    requested: int = 0  # manual requests: the newest id asked for ...
    requests_done: int = 0  # ... and done


class CompactionService:
    """Compacts a daemon's streams in one background thread, one at a time.

    ``session()`` gives the SparkSession to use, or None while Spark is not
    ready (the check is then skipped). Each stream is checked every
    ``compact_interval_s`` (the first time one interval after start), and at
    once when ``request`` asks. A failure is logged, counted, shown in
    ``status`` and retried with backoff; it never touches a live batch.
    """

    TICK_S = 0.5

    def __init__(
        self,
        sinks: Sequence[MaintainedTable],
        session: Callable[[], Any | None],
        metrics: Any = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        now = clock()
        self._streams = {s.name: _StreamState(s, now + s.stream.compact_interval_s) for s in sinks}
        self._session = session
        self._metrics = metrics
        self._clock = clock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None
        self._tag = f"eventplane-compaction-{id(self)}"
        self._spark: Any = None  # the session of the running job (for stop)

    def start(self) -> None:
        if self._streams and self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="eventplane-compaction", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the running compaction (its Spark job is interrupted: rolled back)."""
        self._stop.set()
        self._wake.set()
        spark = self._spark
        if spark is not None:
            with contextlib.suppress(Exception):
                spark.interruptTag(self._tag)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("cdc.compaction_stop_timeout", timeout_s=timeout)
            self._thread = None

    def streams(self) -> list[str]:
        return list(self._streams)

    def request(self, stream: str) -> int | None:
        """Ask for a full compaction of ``stream`` now; the request's id (None: unknown)."""
        st = self._streams.get(stream)
        if st is None:
            return None
        with self._mutex:
            st.requested += 1
            rid = st.requested
        self._wake.set()
        return rid

    def plan(self, stream: str) -> list[dict[str, Any]] | None:
        """What a full compaction would merge now (a dry run); None: unknown stream."""
        st = self._streams.get(stream)
        if st is None:
            return None
        return [p.to_json() for p in plan_stream(st.sink, full=True)]

    def status(self, stream: str) -> dict[str, Any] | None:
        st = self._streams.get(stream)
        if st is None:
            return None
        s = st.sink.stream
        files = dict(st.files)
        ledger = st.sink._ledger
        return {
            "enabled": s.compaction,
            "target_file_bytes": s.target_file_bytes,
            "compact_min_files": s.compact_min_files,
            "interval_s": s.compact_interval_s,
            "running": st.running.to_json() if st.running is not None else None,
            "last": st.last.to_json() if st.last is not None else None,
            "last_id": ledger.last_compaction_id if ledger is not None else None,
            "compactions": st.compactions,
            "files_removed": st.files_removed,
            "failures_in_a_row": st.failures,
            "last_error": st.last_error,
            "last_error_at": st.last_error_at,
            "files": sum(files.values()),
            "files_per_partition": files,
            "max_files_per_partition": max(files.values(), default=0),
            "scanned_at": st.scanned_at,
            "scanned_batch_id": st.scanned_batch_id,
            "requested": st.requested,
            "requests_done": st.requests_done,
            "next_check_in_s": round(max(0.0, st.next_check - self._clock()), 3),
        }

    # -- the thread --------------------------------------------------------

    def _loop(self) -> None:
        for st in self._streams.values():
            self._scan(st)
        while not self._stop.is_set():
            for st in self._streams.values():
                if self._stop.is_set():
                    break
                with self._mutex:
                    wanted = st.requested
                manual = wanted > st.requests_done
                due = st.sink.stream.compaction and self._clock() >= st.next_check
                if not (manual or due):
                    continue
                spark = self._session()
                if spark is None:
                    continue  # Spark not ready: try again next tick
                self._run(st, spark, full=manual, request=wanted if manual else None)
            self._wake.wait(self.TICK_S)
            self._wake.clear()

    def _run(self, st: _StreamState, spark: Any, *, full: bool, request: int | None) -> None:
        interval = st.sink.stream.compact_interval_s
        started = time.monotonic()
        self._spark = spark
        with contextlib.suppress(Exception):
            spark.addTag(self._tag)  # what stop() interrupts
        with contextlib.suppress(Exception):  # classic Spark only (not Connect)
            sc = spark.sparkContext
            sc.setLocalProperty("spark.scheduler.pool", POOL)  # used in FAIR mode
            sc.setJobDescription(f"eventplane compaction of stream {st.sink.name}")

        def running(p: Progress) -> None:
            p.request = request
            if st.running is not None and st.running.step == "done":
                st.last = st.running  # the one before, in the same run
            st.running = p

        done: list[Progress] = []
        try:
            compact_stream(
                st.sink, spark, full=full, on_progress=running, stop=self._stop, done=done
            )
        except Exception as exc:
            failed = st.running
            st.running = None
            st.failures += 1
            st.last_error = f"{type(exc).__name__}: {exc}"[:2000]
            st.last_error_at = time.time()
            if failed is not None:
                st.last = failed
            backoff = min(interval * 2**st.failures, MAX_BACKOFF_S)
            st.next_check = self._clock() + max(backoff, 1.0)
            self._finished(done, st, started)
            self._count("failed", 0, time.monotonic() - started, st)
            log.error(
                "cdc.compaction_failed",
                stream=st.sink.name,
                partition=failed.partition if failed else None,
                id=failed.id if failed else None,
                error=st.last_error,
                failures_in_a_row=st.failures,
                retry_in_s=round(max(backoff, 1.0), 1),
                unsupported=isinstance(exc, CompactionUnsupportedError),
            )
        else:
            st.running = None
            st.failures = 0
            st.last_error = None
            if done:
                st.last = done[-1]
            self._finished(done, st, started)
            st.next_check = self._clock() + interval
        finally:
            with contextlib.suppress(Exception):
                spark.removeTag(self._tag)
            self._spark = None
            if request is not None:
                st.requests_done = max(st.requests_done, request)
            self._scan(st)

    def _finished(self, done: list[Progress], st: _StreamState, started: float) -> None:
        removed = sum(p.inputs - len(p.outputs) for p in done)
        st.compactions += len(done)
        st.files_removed += removed
        if done:
            self._count("done", removed, time.monotonic() - started, st, n=len(done))

    def _scan(self, st: _StreamState) -> None:
        try:
            batch_id = st.sink.ledger.last_batch_id if st.sink._ledger is not None else 0
            st.files = file_counts(st.sink)
            st.scanned_at, st.scanned_batch_id = time.time(), batch_id
        except OSError as exc:
            log.warning("cdc.compaction_scan_failed", stream=st.sink.name, error=str(exc))
            return
        m = self._metrics
        if m is not None:
            m.cdc_table_files.labels(st.sink.name).set(sum(st.files.values()))

    def _count(
        self, outcome: str, removed: int, seconds: float, st: _StreamState, n: int = 1
    ) -> None:
        m = self._metrics
        if m is None:
            return
        m.cdc_compactions.labels(st.sink.name, outcome).inc(n)
        if removed:
            m.cdc_compaction_files_removed.labels(st.sink.name).inc(removed)
        m.cdc_compaction_seconds.labels(st.sink.name).observe(seconds)
