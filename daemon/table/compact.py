"""Compaction of CDC tables: a partition's small files merged into few large ones.

A stream writes at least one file per collection per micro-batch; nothing
else would ever merge them (750k files a day at 1 s batches, and reads 7-11x
slower than the same rows in few files). Compaction merges the small files of
one leaf partition folder (``<path>/collection=X``, or with time partitioning
``<path>/collection=X/date=D`` and ``.../hour=H``) into files near
``target_file_bytes``, and a reader never sees a row twice or misses one
(invariant 16). Only leaves hold data files, and only leaves are swapped.

**Why a folder swap.** Readers list folders: that is the table's contract
(``spark.read.parquet`` of the root or of one partition, a glob, pyarrow,
DuckDB). Replacing N files by one inside a folder cannot be atomic with
renames: between them a listing sees both the merged file and some of its
inputs (duplicates) or neither (missing rows). A whole folder can be swapped
atomically: ``renameat2(..., RENAME_EXCHANGE)`` (Linux 3.15+: ext4, xfs,
btrfs, tmpfs; not NFS) exchanges two names in one step, so a ``readdir`` of
the partition sees the old folder or the new one, never a mix. A file system
without it refuses compaction with :class:`CompactionUnsupportedError`; the
table keeps working uncompacted.

Layout (under ``<path>/_eventplane/``, which no reader lists)::

    compact/c<C>.json                 intent: partition (relative path), inputs, outputs
    compact/c<C>/out/                 where Spark writes the merged files
    compact/c<C>/<partition>/         the new folder (``collection=X`` or
                                      ``collection=X/date=D[/hour=H]``), built
                                      here; after the swap, the old folder

Steps of compaction C of partition P (marked in :func:`run_compaction`):

1. **Pick.** Files of P whose batches are committed (id <= the ledger's last),
   smaller than half the target, chosen by the size-tier policy below; not
   in a partition retention would remove now. Then P is *claimed* under the
   commit lock: it must still hold every input (else retention removed it:
   :class:`PartitionGoneError`, skipped), and retention skips a claimed P
   (``retention.apply``) until the swap or the roll-back releases it.
2. **Write** one file per bin (inputs packed up to ``target_file_bytes``),
   rows sorted by ``lsn``, under ``out/`` (:func:`write_merged`). When the
   inputs agree on their Parquet schema, footer key-values (Spark's schema)
   and codec (the daemon's own files do), pyarrow merges them in this
   process: the same physical schema and footer, the dictionary options of
   files that stay (``PARQUET_OPTIONS``), no JVM job (about 2 µs of CPU per
   row instead of 40). Otherwise one Spark job reads exactly those files
   (with the schema their footers agree on, else ``mergeSchema``: files from
   before a column existed keep their rows) and writes them with
   ``PARQUET_OPTIONS``. The row counts of the outputs' footers must equal the
   inputs'; then the outputs are fsynced.
3. **Intent.** ``c<C>.json`` (atomic replace + fsync).
4. **Build.** The merged files move into ``c<C>/<partition>/`` as
   ``part-c<C>-b<first>-b<last>-...`` (the batches they hold), and every file
   of P that is not an input gets a hard link there; fsync.
5. **Swap.** Under the sink's ``commit_lock`` (no batch publishes meanwhile;
   held for well under a millisecond): files P gained or replaced since step 4 are
   linked, then ``RENAME_EXCHANGE`` of the new folder with P. *This is the
   commit point.* Then fsync of both parents. (A compaction that fails after
   this keeps its claim until :func:`recover` rolls it forward.)
6. **Ledger.** The compaction is recorded in the stream's ledger (id,
   partition, input count and bytes, outputs, batch range, rows), under the
   commit lock like a batch's ledger write.
7. **Clean.** The old folder (now ``c<C>/<partition>``), ``out/`` and the
   intent are deleted.

**Recovery** (:func:`recover`, when a stream opens and before each
compaction): an intent whose outputs are in P rolls forward (ledger, clean);
one whose outputs are not rolls back (its folder is deleted; P was never
touched); one whose P is gone (retention removed it meanwhile) is cleaned
(nothing of P is visible either way). A ``c<C>`` folder without intent is
deleted. P must be a leaf of ``partition_by``, else the intent is refused.

**Readers across a swap.** A reader that listed P before the swap and opens
an input afterwards finds it gone: Spark fails the query with
``[FAILED_READ_FILE.FILE_NOT_EXIST] ... It is possible the underlying files
have been updated``, pyarrow with ``FileNotFoundError``. That is retryable
(list again), never wrong rows. A reader that opened a file keeps reading it.
Spark's ``spark.sql.files.ignoreMissingFiles = true`` would turn that error
into missing rows: do not set it on readers of a CDC table.

**Policy (size tiers).** Re-merging a growing file with each new handful of
small files would rewrite it again and again (a day at 1 s batches and a
check a minute would rewrite ~64 MiB per partition per check). Files below
half the target are sorted into tiers by size, a factor ``F =
compact_min_files`` apart: tier 0 is [T/2F, T/2), tier 1 [T/2F², T/2F), ...
When a tier holds F files, they and every smaller file are merged; the result
lands at least one tier up. Each row is rewritten about ``log_F(T / batch
file size)`` times (3-4 at the defaults), and a partition keeps fewer than F
files per tier plus files near the target: the count grows with the data, not
with the batches. ``eventplane cdc compact`` merges every file below half the
target at once (``full``).

Compactions of a daemon run one at a time in their own thread
(:class:`CompactionService`), beside the batches: a compaction never holds a
live commit, which only waits for the swap's lock.

**In-process merge, memory.** pyarrow reads a bin's inputs a row group at
a time: whole groups of files whose ``lsn`` ranges (from their footers'
statistics) overlap, usually one file each, up to
``ARROW_ROW_GROUP_INPUT_BYTES`` (16 MiB of Parquet), sorted together by
``lsn`` and written as one row group (groups are disjoint, so the file is
sorted). A group over ``ARROW_MAX_SORT_BYTES`` (the same 16 MiB) goes to
the Spark job, which spills. So a merge holds about one row group decoded
(3-6x its Parquet bytes), twice while sorting, whatever the target size.
It takes one thread and cannot be interrupted: a stop waits for it
(about 1.4 s of CPU per 100 MiB of input, measured here).
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
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from daemon.table import retention
from daemon.table.crash import crash_point
from daemon.table.durable import atomic_write_json, fsync_dir, fsync_file
from daemon.table.errors import CdcError, CdcRecoveryError
from daemon.table.layout import _COMPACTED, _PUBLISHED, PARQUET_OPTIONS
from daemon.table.sink import MaintainedTable, RecoveryReport
from daemon.table.snapshot import table_change
from daemon.table.sparkio import staging_write_options

log = structlog.get_logger("eventplane.cdc")

COMPACT_DIR = "compact"
RENAME_EXCHANGE = 1 << 1  # <linux/fs.h>
_AT_FDCWD = -100
_INTENT = re.compile(r"c(\d{12})\.json")
_WORK = re.compile(r"c(\d{12})")
_TASK = re.compile(r"^part-(\d{5})-")
# Footer key under which Spark records the schema it wrote.
SPARK_SCHEMA_KEY = b"org.apache.spark.sql.parquet.row.metadata"
# A file this large (relative to the target) is done: never an input again.
DONE_RATIO = 0.5
# Most bins (output files) one compaction writes; more wait for the next one.
MAX_BINS = 8
# Spark scheduler pool of compaction jobs: with spark.scheduler.mode = FAIR they
# share the executors with the batches instead of going first (FIFO).
POOL = "eventplane-compaction"
# Backoff of a stream whose compaction failed: doubling from the interval, up to this.
MAX_BACKOFF_S = 3600.0


class CompactionError(CdcError):
    """A compaction failed; it was rolled back (or rolls forward on its next run)."""


class CompactionUnsupportedError(CompactionError):
    """The file system cannot swap two folders atomically (renameat2 RENAME_EXCHANGE)."""


class PartitionGoneError(CompactionError):
    """The planned partition (or some of its files) went before the compaction
    claimed it: retention removed it. Nothing was done; not a failure."""


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
# What to merge


@dataclass(frozen=True, slots=True)
class DataFile:
    name: str
    size: int
    first: int  # first and last batch whose rows it holds
    last: int
    compaction: int | None = None  # the compaction that wrote it


def data_files(folder: Path) -> list[DataFile]:
    """The data files of a partition folder, recognised by name."""
    out: list[DataFile] = []
    with os.scandir(folder) as it:
        for e in it:
            m = _PUBLISHED.match(e.name)
            if m:
                b = int(m.group(1))
                out.append(DataFile(e.name, e.stat().st_size, b, b))
                continue
            m = _COMPACTED.match(e.name)
            if m:
                out.append(
                    DataFile(
                        e.name, e.stat().st_size, int(m.group(2)), int(m.group(3)), int(m.group(1))
                    )
                )
    return out


def partitions(path: Path, partition_by: Sequence[str] = ("collection",)) -> list[Path]:
    """The visible leaf partition folders of a table: ``collection=X``, or with
    time partitioning ``collection=X/date=D`` (``.../hour=H``), each level named
    by its ``partition_by`` column. Only leaves hold data files, and only they
    are swapped; the folders above them never are."""
    level = [path]
    for col in partition_by:
        below: list[Path] = []
        for folder in level:
            try:
                below += (
                    d for d in folder.iterdir() if d.name.startswith(f"{col}=") and d.is_dir()
                )
            except FileNotFoundError:  # retention removed an emptied date folder
                continue
        level = below
    return sorted(level)


def rel(sink: MaintainedTable, folder: Path) -> str:
    """A partition's path relative to the table (``collection=X/date=D``): its
    name in plans, intents, the ledger and status."""
    return folder.relative_to(sink.path).as_posix()


def tier(size: int, target: int, factor: int) -> int | None:
    """The size tier of a file (0: just below ``DONE_RATIO * target``); None when done."""
    bound = target * DONE_RATIO
    if size >= bound:
        return None
    k = 0
    while size < bound / factor and k < 64:
        bound /= factor
        k += 1
    return k


@dataclass(slots=True)
class Plan:
    """One compaction: a partition's inputs, packed into bins (one output each)."""

    partition: str
    mode: str  # "tiered" (background) or "full" (eventplane cdc compact)
    bins: list[list[DataFile]]
    files: int  # data files in the partition before
    reason: str = ""

    @property
    def inputs(self) -> list[DataFile]:
        return [f for b in self.bins for f in b]

    @property
    def input_bytes(self) -> int:
        return sum(f.size for f in self.inputs)

    def to_json(self) -> dict[str, Any]:
        ins = self.inputs
        return {
            "partition": self.partition,
            "mode": self.mode,
            "reason": self.reason,
            "files_before": self.files,
            "inputs": len(ins),
            "input_bytes": self.input_bytes,
            "outputs": len(self.bins),
            "files_after": self.files - len(ins) + len(self.bins),
            "first_batch": min(f.first for f in ins),
            "last_batch": max(f.last for f in ins),
        }


def pack(files: Iterable[DataFile], target: int, max_bins: int = MAX_BINS) -> list[list[DataFile]]:
    """Inputs in batch order, packed into bins of at most ``target`` bytes; bins of
    one file are dropped (nothing to merge)."""
    bins: list[list[DataFile]] = []
    current: list[DataFile] = []
    size = 0
    for f in sorted(files, key=lambda f: (f.first, f.last, f.name)):
        if current and size + f.size > target:
            bins.append(current)
            current, size = [], 0
        current.append(f)
        size += f.size
    if current:
        bins.append(current)
    return [b for b in bins if len(b) > 1][:max_bins]


def plan_partition(
    name: str,
    files: Sequence[DataFile],
    *,
    target: int,
    min_files: int,
    last_committed: int,
    full: bool = False,
) -> Plan | None:
    """What to merge in one partition now, or None (see the module doc, Policy)."""
    small = [f for f in files if f.last <= last_committed and f.size < target * DONE_RATIO]
    if full:
        bins = pack(small, target)
        reason = f"{len(small)} files below {int(target * DONE_RATIO)} bytes"
    else:
        tiers: dict[int, list[DataFile]] = {}
        for f in small:
            k = tier(f.size, target, min_files)
            if k is not None:
                tiers.setdefault(k, []).append(f)
        due = [k for k, fs in tiers.items() if len(fs) >= min_files]
        if not due:
            return None
        k = min(due)  # the largest due tier, with every smaller file
        chosen = [f for j, fs in tiers.items() if j >= k for f in fs]
        bins = pack(chosen, target)
        reason = f"tier {k} holds {len(tiers[k])} files (compact_min_files {min_files})"
    if not bins:
        return None
    return Plan(name, "full" if full else "tiered", bins, len(files), reason)


def _own_compaction(sink: MaintainedTable) -> Callable[..., Any] | None:
    """The table format's own compaction (Delta's OPTIMIZE: ``DeltaSink.compact``),
    or None for the Parquet folders this module compacts."""
    return getattr(sink, "compact", None)


def plan_stream(sink: MaintainedTable, *, full: bool = False) -> list[Plan]:
    """Every leaf partition of the stream that has something to merge now.

    A time-partitioned stream is compacted per ``date`` (``hour``) folder. A
    partition retention would remove now is skipped: merging it is wasted
    work, and retention should not have to wait for it.
    """
    if _own_compaction(sink) is not None:
        return []  # the format plans its own compaction
    s = sink.stream
    last = sink.ledger.last_batch_id
    expired: set[str] = set()
    if s.retention_s is not None:
        expired = {p.rel for p in retention.plan(s, count=False).expired}
    out = []
    for folder in partitions(sink.path, s.partition_by):
        name = rel(sink, folder)
        if name in expired:
            continue
        try:
            files = data_files(folder)
        except FileNotFoundError:  # removed by retention since the listing
            continue
        plan = plan_partition(
            name,
            files,
            target=s.target_file_bytes,
            min_files=s.compact_min_files,
            last_committed=last,
            full=full,
        )
        if plan is not None:
            out.append(plan)
    return out


def file_counts(sink: MaintainedTable) -> dict[str, int]:
    """Data files per leaf partition folder, by its relative path (none for a
    table format whose log, not its folders, says which files count)."""
    if _own_compaction(sink) is not None:
        return {}
    out = {}
    for d in partitions(sink.path, sink.stream.partition_by):
        with contextlib.suppress(FileNotFoundError):
            out[rel(sink, d)] = len(data_files(d))
    return out


# --------------------------------------------------------------------------
# Progress


@dataclass(slots=True)
class Progress:
    """One compaction, as status and the CLI show it."""

    stream: str
    partition: str
    mode: str
    inputs: int
    input_bytes: int
    bins: int
    first_batch: int
    last_batch: int
    id: int | None = None
    step: str = "planned"  # writing, swapping, cleaning, done, failed, skipped
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    outputs: list[str] = field(default_factory=list)
    output_bytes: int = 0
    rows: int = 0
    lock_wait_s: float = 0.0
    lock_held_s: float = 0.0
    error: str | None = None
    request: int | None = None

    @classmethod
    def of(cls, stream: str, plan: Plan) -> Progress:
        ins = plan.inputs
        return cls(
            stream,
            plan.partition,
            plan.mode,
            len(ins),
            plan.input_bytes,
            len(plan.bins),
            min(f.first for f in ins),
            max(f.last for f in ins),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "partition": self.partition,
            "mode": self.mode,
            "step": self.step,
            "inputs": self.inputs,
            "input_bytes": self.input_bytes,
            "outputs": len(self.outputs) or self.bins,
            "output_bytes": self.output_bytes,
            "rows": self.rows,
            "first_batch": self.first_batch,
            "last_batch": self.last_batch,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "seconds": None
            if self.finished_at is None
            else round(self.finished_at - self.started_at, 3),
            "lock_wait_s": round(self.lock_wait_s, 6),
            "lock_held_s": round(self.lock_held_s, 6),
            "error": self.error,
            "request": self.request,
        }


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


def _common_schema(files: Iterable[Path]) -> Any:
    """The Spark schema every file's footer records, or None when they differ
    (or one records none)."""
    import pyarrow.parquet as pq
    from pyspark.sql.types import StructType

    found: set[bytes] = set()
    for f in files:
        found.add((pq.read_metadata(f).metadata or {}).get(SPARK_SCHEMA_KEY, b""))
        if len(found) > 1:
            return None
    text = found.pop() if found else b""
    if not text:
        return None
    try:
        return StructType.fromJson(json.loads(text))
    except (ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------
# Step 2 in process: pyarrow merges files that agree on everything Spark wrote

# Codecs of the inputs the in-process merge writes again, as pyarrow names them,
# at the level Spark's Parquet writer (parquet-mr) uses by default; another codec
# (LZ4, BROTLI, LZO: framing or support differ) goes to the Spark job.
ARROW_CODECS: dict[str, tuple[str, int | None]] = {
    "SNAPPY": ("snappy", None),
    "ZSTD": ("zstd", 3),
    "GZIP": ("gzip", 6),
    "UNCOMPRESSED": ("none", None),
}
# File name suffix Spark gives each codec (``part-...-c000.snappy.parquet``).
_CODEC_SUFFIX = {"SNAPPY": ".snappy", "ZSTD": ".zstd", "GZIP": ".gz", "UNCOMPRESSED": ""}
# Parquet bytes of inputs read, sorted and written together as one row group
# of a merged file (in memory: 3-6x this decoded, twice while sorting).
ARROW_ROW_GROUP_INPUT_BYTES = 16 * 1024 * 1024
# Files whose ``lsn`` ranges overlap are sorted together, so they must fit in
# one row group: a group of more Parquet bytes than this (a batch file of
# over 16 MiB, or overlapping ones) goes to the Spark job, which spills. Files
# of different batches rarely overlap, so a group is usually one file.
ARROW_MAX_SORT_BYTES = ARROW_ROW_GROUP_INPUT_BYTES


class _ArrowMismatchError(CompactionError):
    """pyarrow wrote a file whose Parquet schema or footer differs from its inputs'."""


@dataclass(frozen=True, slots=True)
class ArrowLayout:
    """What every input's footer agrees on, and what the merged files repeat."""

    schema: Any  # pyarrow.parquet.ParquetSchema
    metadata: dict[bytes, bytes]  # Spark's footer keys: its schema, its version
    codec: str  # Parquet's name: SNAPPY, ZSTD, GZIP, UNCOMPRESSED
    dictionary: list[str]  # leaf columns written with a dictionary
    ranges: dict[str, tuple[int, int] | None]  # input -> lsn range (footer statistics)
    sizes: dict[str, int]  # input -> bytes


def arrow_layout(folder: Path, plan: Plan) -> ArrowLayout | str:
    """The inputs' common layout, or why pyarrow does not merge them (a reason).

    pyarrow merges when every input has the same Parquet schema (columns,
    physical and logical types, repetition), the same footer key-values
    (``org.apache.spark.sql.parquet.row.metadata`` is what makes Spark read the
    binary ``new``/``old`` groups as VARIANT; it must describe the merged file
    exactly as it describes each input), no INT96 timestamps (Spark's own
    encoding and rebasing), and one codec that pyarrow writes as Spark does.
    Files from before a column existed fail the first test: Spark's
    ``mergeSchema`` gives their rows the new column as nulls.
    """
    import pyarrow.parquet as pq

    first: Any = None
    lsn = -1
    codecs: set[str] = set()
    ranges: dict[str, tuple[int, int] | None] = {}
    sizes: dict[str, int] = {}
    for f in plan.inputs:
        md = pq.read_metadata(folder / f.name)
        if first is None:
            first = md
            if SPARK_SCHEMA_KEY not in (md.metadata or {}):
                return f"{f.name} has no Spark schema in its footer"
            paths = [md.schema.column(i).path for i in range(md.num_columns)]
            if "lsn" not in paths:
                return f"{f.name} has no lsn column"
            lsn = paths.index("lsn")
            if any(md.schema.column(i).physical_type == "INT96" for i in range(md.num_columns)):
                return f"{f.name} has INT96 timestamps"
        elif not md.schema.equals(first.schema):
            return f"{f.name} and {plan.inputs[0].name} have different Parquet schemas"
        elif (md.metadata or {}) != (first.metadata or {}):
            return f"{f.name} and {plan.inputs[0].name} have different footer metadata"
        lo: int | None = None
        hi: int | None = None
        known = True
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            codecs.update(rg.column(c).compression for c in range(rg.num_columns))
            if rg.num_rows == 0:
                continue
            stats = rg.column(lsn).statistics
            if stats is None or not stats.has_min_max:
                known = False
                continue
            lo = stats.min if lo is None else min(lo, stats.min)
            hi = stats.max if hi is None else max(hi, stats.max)
        ranges[f.name] = (int(lo), int(hi)) if known and lo is not None and hi is not None else None
        sizes[f.name] = f.size
    if len(codecs) != 1 or next(iter(codecs)) not in ARROW_CODECS:
        return f"codecs {sorted(codecs)} (pyarrow writes one of {sorted(ARROW_CODECS)})"
    # The writer options of files that stay (a compacting stream's batch files
    # skip more, cdc.TRANSIENT_PARQUET_OPTIONS): Spark's default dictionary for
    # every column but those PARQUET_OPTIONS turns it off for. (The inputs' own
    # choice is no guide: Spark's writer drops a dictionary that does not pay
    # off on its first page, which in a 125-row batch file it rarely does.)
    dictionary = [
        p for p in paths if PARQUET_OPTIONS.get(f"parquet.enable.dictionary#{p}") != "false"
    ]
    return ArrowLayout(first.schema, dict(first.metadata), codecs.pop(), dictionary, ranges, sizes)


def sort_groups(bin_: Sequence[DataFile], layout: ArrowLayout) -> list[list[str]] | str:
    """A bin's inputs as groups of files whose lsn ranges overlap, in lsn order
    (sorting each group alone and writing the groups in order sorts the bin),
    or why not: a group over ``ARROW_MAX_SORT_BYTES``."""
    names = [f.name for f in bin_]
    known = sorted((r, n) for n in names if (r := layout.ranges.get(n)) is not None)
    groups: list[list[str]] = []
    if len(known) < len(names):  # a file without statistics: sort the bin as a whole
        groups = [names]
    else:
        hi = 0
        for (lo, top), n in known:
            if groups and lo <= hi:
                groups[-1].append(n)
                hi = max(hi, top)
            else:
                groups.append([n])
                hi = top
    for g in groups:
        size = sum(layout.sizes[n] for n in g)
        if size > ARROW_MAX_SORT_BYTES:
            return (
                f"{len(g)} inputs of {size} bytes overlap in lsn "
                f"(the in-process sort takes at most {ARROW_MAX_SORT_BYTES})"
            )
    return groups


def write_merged_arrow(
    folder: Path, plan: Plan, out: Path, layout: ArrowLayout, groups: list[list[list[str]]]
) -> None:
    """Step 2 in this process: one file per bin under ``out`` (``groups[i]``:
    bin i's inputs by :func:`sort_groups`), rows sorted by lsn, with the inputs'
    Parquet schema, codec and footer key-values and the dictionary options of
    files that stay (``PARQUET_OPTIONS``). Raises ``_ArrowMismatchError`` when
    a written file's schema or footer is not the inputs'."""
    import pyarrow.parquet as pq

    codec, level = ARROW_CODECS[layout.codec]
    arrow_schema = layout.schema.to_arrow_schema().remove_metadata()
    out.mkdir(parents=True, exist_ok=True)
    for i, bin_groups in enumerate(groups):
        dest = out / f"part-{i:05d}-{uuid.uuid4()}-c000{_CODEC_SUFFIX[layout.codec]}.parquet"
        with pq.ParquetWriter(
            dest,
            arrow_schema,
            compression=codec,
            compression_level=level,
            use_dictionary=layout.dictionary,
            write_statistics=True,
            write_page_index=True,  # Spark writes column and offset indexes too
            store_schema=False,  # no ARROW:schema key: the footer stays Spark's
        ) as writer:
            # Groups are disjoint and in lsn order: sorting the rows of several
            # whole groups at once sorts each. So whole groups are read
            # together, up to ARROW_ROW_GROUP_INPUT_BYTES, sorted once and
            # written as one row group.
            chunk: list[str] = []
            size = 0
            for group in bin_groups:
                more = sum(layout.sizes[n] for n in group)
                if chunk and size + more > ARROW_ROW_GROUP_INPUT_BYTES:
                    _write_row_group(writer, folder, chunk, arrow_schema)
                    chunk, size = [], 0
                chunk += group
                size += more
            if chunk:
                _write_row_group(writer, folder, chunk, arrow_schema)
            writer.add_key_value_metadata(layout.metadata)
        written = pq.read_metadata(dest)
        if not written.schema.equals(layout.schema) or written.metadata != layout.metadata:
            raise _ArrowMismatchError(
                f"pyarrow wrote {dest.name} with another schema or footer than its inputs "
                f"({written.schema} vs {layout.schema})"
            )


def _write_row_group(writer: Any, folder: Path, names: list[str], schema: Any) -> None:
    """The files' rows (whole groups), sorted by lsn, as one row group."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    from pyarrow.fs import LocalFileSystem

    # A dataset scan in one thread: a compaction takes at most one core from the
    # batches, and for files of a few hundred rows it costs half the CPU of
    # opening each with pq.ParquetFile (whose Python side is per file).
    paths = [str(folder / n) for n in names]
    rows = ds.dataset(paths, schema=schema, format="parquet", filesystem=LocalFileSystem())
    table = rows.to_table(use_threads=False)
    lsn = table.column("lsn")
    ordered = lsn.null_count == 0 and pc.all(pc.less(lsn[:-1], lsn[1:])).as_py()
    if len(lsn) > 1 and not ordered:
        table = table.take(pc.sort_indices(lsn))
    writer.write_table(table, row_group_size=max(table.num_rows, 1))


def write_merged(spark: Any, folder: Path, plan: Plan, out: Path) -> None:
    """Step 2: one output file per bin under ``out`` (tests wrap it).

    In this process with pyarrow when the inputs agree (:func:`arrow_layout`;
    the daemon's own files always do), else, or when pyarrow's file came out
    different, with a Spark job (:func:`write_merged_spark`).
    """
    layout = arrow_layout(folder, plan)
    reason = layout if isinstance(layout, str) else ""
    if isinstance(layout, ArrowLayout):
        groups: list[list[list[str]]] = []
        for b in plan.bins:
            g = sort_groups(b, layout)
            if isinstance(g, str):
                reason = g
                break
            groups.append(g)
        else:
            try:
                write_merged_arrow(folder, plan, out, layout, groups)
                return
            except _ArrowMismatchError as exc:
                reason = str(exc)
                shutil.rmtree(out, ignore_errors=True)
    log.info("cdc.compaction_with_spark", partition=plan.partition, reason=reason[:500])
    write_merged_spark(spark, folder, plan, out)


def write_merged_spark(spark: Any, folder: Path, plan: Plan, out: Path) -> None:
    """Step 2 as a Spark job: one output file per bin under ``out``."""
    # One schema for every bin: the inputs' Spark schema when their footers
    # agree (no Spark job), else the union Spark merges (a file from before a
    # column existed must not decide the output's columns).
    schema = _common_schema(folder / f.name for f in plan.inputs)
    if schema is None:
        reader = spark.read.option("mergeSchema", "true").option("basePath", str(folder))
        schema = reader.parquet(*(str(folder / f.name) for f in plan.inputs)).schema
    frames = []
    for b in plan.bins:
        df = (
            spark.read.schema(schema)
            .option("basePath", str(folder))
            .parquet(*(str(folder / f.name) for f in b))
        )
        frames.append(df.coalesce(1))
    merged = frames[0]
    for df in frames[1:]:
        merged = merged.union(df)  # keeps the partitions: one task (file) per bin
    writer = merged.sortWithinPartitions("lsn").write.mode("overwrite")
    # The staging write's file system: no ``.crc`` or ``_SUCCESS`` beside the
    # merged files (``_outputs`` skipped them) and, where the daemon's jar is
    # loaded, no forked ``chmod`` per file and folder.
    writer.options(**PARQUET_OPTIONS, **staging_write_options(spark)).parquet(str(out))


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
            st.files = file_counts(st.sink)
            st.scanned_at = time.time()
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
