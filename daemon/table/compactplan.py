"""What to compact: a table's leaf partitions, their data files, the size-tier policy.

Compaction (:mod:`daemon.table.compact`) merges the small files of one leaf
partition folder. This module decides which, without touching a file:
:func:`plan_stream` lists the leaves (:func:`partitions`) and their data files
(:func:`data_files`, recognised by name), and :func:`plan_partition` applies
the policy to each, giving a :class:`Plan` (inputs packed into bins, one
output file each). :class:`Progress` is one compaction as status shows it.

**Policy (size tiers).** Files below half the target are sorted into tiers a
factor ``F = compact_min_files`` apart: tier 0 is [T/2F, T/2), tier 1
[T/2F², T/2F), ... When a tier holds F files, they and every smaller file are
merged; ``full`` (``eventplane cdc compact``) merges every file below half the
target. Only files of committed batches count, and a partition retention
would remove now is skipped. The why: docs/cdc.md, "Compaction" (Policy).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.table import retention
from daemon.table.layout import _COMPACTED, _PUBLISHED
from daemon.table.sink import MaintainedTable

# A file this large (relative to the target) is done: never an input again.
DONE_RATIO = 0.5
# Most bins (output files) one compaction writes; more wait for the next one.
MAX_BINS = 8


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
