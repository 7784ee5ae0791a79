"""A consistent list of a CDC table's files: the table's generation (a seqlock).

**Why.** Readers find a table's rows by listing its folders: they read a
folder's names, then look each name up again (``stat``) and open it later.
Spark's local file system and pyarrow both *skip*, without a word, a name
that is gone between the listing and the look-up. A compaction swaps a whole
partition folder in one step (``daemon/table/compact.py``), so a ``readdir``
sees the old folder or the new one; but a reader that read the old folder's
names and looks them up after the swap finds the merged-away inputs gone and
skips them, and it never listed the merged file: it silently misses the
inputs' rows. No order of renames can prevent that for a reader that lists
once and looks up later (tried here with a swap loop: 49 of 160 pyarrow
listings and 167 of 354 Spark listings missed rows). Retention's removal of a
partition has the same window.

**The generation.** Every change that removes visible files (a compaction's
swap, retention's removal of a partition) is bracketed by the stream's
generation, in ``<path>/_eventplane/generation``:

1. under the stream's commit lock, the generation goes from even ``2k`` to odd
   ``2k+1`` (atomic replace);
2. the folder is swapped or removed;
3. the generation goes to ``2k+2``.

A batch commit only adds files (each rename is atomic) and does not touch it.
When a stream opens, the generation moves to the next even number, so a
reader whose listing spans a restart lists again.

**Any reader** (:func:`consistent`): read the generation; if it is odd, wait
and read it again; run the reader's listing (make the Spark DataFrame, the
pyarrow dataset, or run a lazy reader's whole query); read the generation
again. Equal: no file was removed while the reader listed, so what it listed
holds every row committed before it began, exactly once. Otherwise run it
again. A compaction after the listing can still remove a file before the
reader opens it: that fails the read with a file-not-found error (retryable),
never with wrong rows. A file list alone is not enough: Spark skips, without
an error, an explicitly named file that is gone when it builds its index
(its "root path" rule), so a reader of a list checks the generation after
building too. :func:`snapshot` is the list, for tools outside Python
(``eventplane cdc files --json`` prints its generation).

A generation that stays odd means a writer stopped between steps 1 and 3
(killed): the next open of the stream ends it. Meanwhile a reader that finds
the stream's lock holder gone (same host, process not running) lists anyway:
without a writer nothing changes the folders. This module imports nothing
heavy: readers use it without Spark.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from daemon.errors import DaemonError

T = TypeVar("T")

META_DIR = "_eventplane"
GENERATION_FILE = "generation"
LOCK_FILE = "lock"
# How long a reader waits for an odd generation to end before it checks the
# writer or gives up. A swap holds it odd for about a millisecond (a rename
# and two small file replaces under the commit lock).
DEFAULT_WAIT_S = 10.0
# Listings retried before giving up: each retry means a change landed during
# the listing, which a compaction does at most once a minute per partition.
MAX_ATTEMPTS = 100


class SnapshotError(DaemonError):
    """No consistent listing of the table could be taken."""


class TableBusyError(SnapshotError):
    """The table's generation stayed odd (a change in progress) past the wait."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The data files of a table at one generation."""

    root: str
    generation: int
    files: list[str]  # absolute paths, sorted; partition folders are part of each path
    attempts: int  # listings taken (1 when nothing changed meanwhile)


def generation_path(root: Path) -> Path:
    return root / META_DIR / GENERATION_FILE


def read_generation(root: Path) -> int:
    """The table's generation; 0 when the file does not exist yet."""
    try:
        raw = generation_path(root).read_bytes()
    except FileNotFoundError:
        return 0
    try:
        return int(raw.strip() or b"0")
    except ValueError as exc:
        raise SnapshotError(
            f"{generation_path(root)} holds {raw[:40]!r}, not a generation number; it is "
            f"written atomically by eventplane, so something else changed it. Remove it: "
            f"the stream writes it again when it opens."
        ) from exc


def _write_generation(root: Path, value: int) -> None:
    # Readers only compare values read during one listing: a replace without
    # fsync is enough (after a power loss the stream's open moves it on anyway).
    target = generation_path(root)
    tmp = target.with_name(f".{GENERATION_FILE}.{os.getpid()}.tmp")
    tmp.write_bytes(b"%d\n" % value)
    os.replace(tmp, target)


def open_generation(root: Path) -> int:
    """When a stream opens: the next even generation (ends a writer's odd one)."""
    value = read_generation(root)
    value = value + 1 if value % 2 else value + 2
    _write_generation(root, value)
    return value


_change_locks: dict[Path, threading.Lock] = {}
_change_locks_guard = threading.Lock()


@contextlib.contextmanager
def table_change(root: Path) -> Iterator[None]:
    """Steps 1 and 3 around a change that removes visible files.

    Changes of one table are serialised here (a compaction and a retention
    run live in different threads, and interleaved bumps could leave the
    generation even during a change); other processes are fenced by the
    stream's lock file, which the caller holds."""
    with _change_locks_guard:
        lock = _change_locks.setdefault(root.absolute(), threading.Lock())
    with lock:
        value = read_generation(root)
        if value % 2:
            value += 1  # a killed writer's odd generation: the open did not end it
        _write_generation(root, value + 1)
        try:
            yield
        finally:
            _write_generation(root, value + 2)


def data_files(root: Path) -> list[str]:
    """Every file a reader of the table counts: files below the root's visible
    partition folders, at any depth, not hidden (``_``/``.``)."""
    out: list[str] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        if folder == str(root):
            continue  # files at the root are not data (_common_metadata)
        out.extend(os.path.join(folder, n) for n in names if not n.startswith(("_", ".")))
    out.sort()
    return out


def _holder_gone(root: Path) -> bool:
    """True when the stream's lock file names a process of this host that is
    not running (so no writer can change the folders)."""
    try:
        record = json.loads((root / META_DIR / LOCK_FILE).read_bytes() or b"{}")
        pid, host = int(record["pid"]), str(record["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # running, as another user
    return False


def snapshot(
    path: str | os.PathLike[str],
    *,
    wait_s: float = DEFAULT_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    lister: Callable[[Path], list[str]] = data_files,
) -> Snapshot:
    """A consistent list of the table's data files (module doc, "Any reader").

    Raises :class:`TableBusyError` when a change stays in progress for
    ``wait_s`` while its writer runs, :class:`SnapshotError` when the table
    kept changing for ``MAX_ATTEMPTS`` listings, ``FileNotFoundError`` when
    ``path`` does not exist.
    """
    root = Path(path).absolute()
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder (a CDC stream's path)")
    files, generation, attempts = _bracketed(root, lambda: lister(root), wait_s, clock, sleep)
    return Snapshot(str(root), generation, files, attempts)


def consistent(
    path: str | os.PathLike[str],
    build: Callable[[], T],
    *,
    wait_s: float = DEFAULT_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``build()`` run so that no change removed files of the table meanwhile:
    its result reflects one state of the table (module doc, "Any reader").

    ``build`` is a read that lists the table: ``spark.read.parquet(path)``
    (Spark lists when the DataFrame is made), ``ds.dataset(path, ...)``, or a
    whole query of a lazy reader (Polars, DuckDB). When the generation moved
    while it ran, or it failed while the generation moved, it runs again; an
    error of its own (the generation did not move) is raised as is.
    """
    result, _, _ = _bracketed(Path(path).absolute(), build, wait_s, clock, sleep)
    return result


def _bracketed(
    root: Path,
    build: Callable[[], T],
    wait_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> tuple[T, int, int]:
    """``build()`` between two reads of an even generation, again until they
    agree: (its result, the generation, the attempts it took)."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        before = _even_generation(root, wait_s, clock, sleep)
        try:
            result = build()
        except Exception:
            if read_generation(root) != before:
                continue  # a swap or removal cut through the read: read again
            raise
        if read_generation(root) == before:
            return result, before, attempt
    raise SnapshotError(
        f"{root}: the table changed during each of {MAX_ATTEMPTS} listings; compactions or "
        f"retention are running far more often than they should (compact_interval_s)"
    )


def _even_generation(
    root: Path, wait_s: float, clock: Callable[[], float], sleep: Callable[[float], None]
) -> int:
    """The generation once it is even; or the odd one, when it stayed odd for
    ``wait_s`` because its writer was killed."""
    started = clock()
    delay = 0.0005
    while True:
        value = read_generation(root)
        if value % 2 == 0:
            return value
        waited = clock() - started
        if waited >= wait_s:
            if _holder_gone(root):
                return value  # nothing can change the folders without a writer
            raise TableBusyError(
                f"{root}: a compaction or retention run has held the table's generation "
                f"({generation_path(root)} = {value}) odd for {waited:.1f} s and its writer "
                f"still runs; retry, or look at the daemon's log (cdc.compaction_*, "
                f"cdc.retention_*)"
            )
        sleep(delay)
        delay = min(delay * 2, 0.05)
