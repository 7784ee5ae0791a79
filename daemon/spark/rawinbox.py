"""The raw inbox: a batch's WAL payloads handed to Spark as the WAL holds them.

On local masters the batch reaches Spark through a file in
``<data_dir>/spark-inbox``. The Parquet inbox (``daemon.spark.frame``) decodes
every payload into Arrow columns in this process first: about 0.6 CPU-µs per
event on the interpreter that also runs ingest, and time in which Spark waits
for the file. The raw inbox writes the payloads' bytes as they are, with their
LSNs and sequences, and the daemon's jar (``eventplane.inbox.InboxSource``,
``jvm/src/eventplane/inbox``) decodes them inside Spark's tasks, in parallel,
into the same columns (docs/performance.md, "Batches without a Spark job").

File: chunks back to back, each one core's events in LSN order (the layout is
in ``InboxReader.java``; integers little-endian). The file is cut into
*splits* of whole chunks, one Spark task each: one per core, of equal rows
(``frame.write_raw_file`` says why not more).

It is used when the session's JVM can load the reader (the jar is built, the
master is local); otherwise the Parquet inbox is, and the first session says
why, once per process.
"""

from __future__ import annotations

import struct
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import structlog

log = structlog.get_logger("eventplane.spark")

SOURCE = "eventplane.inbox.InboxSource"
SUFFIX = ".epin"
# Joins the collection names of the reader's "collections" option (RowFilter.java).
ROW_FILTER_SEPARATOR = "\x1f"
MAGIC = 0x31435045  # "EPC1" little-endian
_HEADER = struct.Struct("<IIIIQQ")  # magic, count, core, flags (0), reserved (0), data bytes
# Most events in a chunk: a chunk is one columnar batch in Spark's task.
CHUNK_ROWS = 4096
# Most payload bytes in a chunk, by the batch's mean event size: the task
# holds one chunk and its columns at a time.
CHUNK_BYTES = 4 << 20
_LITTLE = sys.byteorder == "little"

_usable: tuple[Any, str | None] | None = None  # (session, why not) of the last check
_fallback_logged = False


class _Head(msgspec.Struct, array_like=True, gc=False):
    """A stored event's first field; msgspec skips the rest of the array."""

    collection: str


_heads = msgspec.msgpack.Decoder(list[_Head])


def missing(spark: Any) -> str | None:
    """Why ``spark``'s session cannot read a raw inbox (None: it can).

    Decided once per session (one py4j call); the first session that cannot
    logs ``spark_inbox_parquet`` with the reason, once per process."""
    global _usable, _fallback_logged
    if _usable is not None and _usable[0] is spark:
        return _usable[1]
    reason = _why_not(spark)
    _usable = (spark, reason)
    if reason is not None and not _fallback_logged:
        _fallback_logged = True
        log.info("spark_inbox_parquet", reason=reason)
    return reason


def _why_not(spark: Any) -> str | None:
    from daemon.spark.session import daemon_class_missing

    return daemon_class_missing(spark, SOURCE)


def write(
    path: Path,
    chunks: Iterable[tuple[int, Any, Any, bytes, Any]],
    total: int,
    groups: int,
    count_collections: bool,
) -> tuple[int, dict[str, int] | None, str]:
    """Write ``chunks`` (``(core, lsns, seqs, payloads, starts)``: int64 numpy
    arrays, the payloads back to back, where each starts) to ``path``; returns
    ``(rows, rows per collection or None when not counted, splits)``.

    ``splits`` is the reader's option: ``offset:length`` of each of ``groups``
    splits of whole chunks, the k-th ending after row ``k * total // groups``
    (a chunk that crosses that row is cut there), so the tasks get equal rows.
    Rows per collection are counted only when asked (a CDC stream that takes
    some collections needs them; ~0.15 µs per event)."""
    counts: Counter[str] | None = Counter() if count_collections else None
    splits: list[str] = []
    rows = offset = split_start = 0
    k = 1
    end = total // groups if groups > 1 else total  # the row the current split ends after
    with open(path, "wb") as f:
        for core, lsns, seqs, data, starts in chunks:
            view = memoryview(data)
            while len(lsns):
                n = len(lsns)
                cut = min(n, end - rows) if end > rows else n
                if cut < n:  # the chunk crosses the split's last row: cut it there
                    at = int(starts[cut])
                    head = (lsns[:cut], seqs[:cut], view[:at], starts[:cut])
                    lsns, seqs, view, starts = lsns[cut:], seqs[cut:], view[at:], starts[cut:] - at
                else:
                    head, lsns = (lsns, seqs, view, starts), lsns[:0]
                offset += _write_chunk(f, core, *head)
                rows += cut
                if counts is not None:
                    counts.update(h.collection for h in _heads.decode(_array_of(cut, head[2])))
                if rows == end and k < groups:
                    splits.append(f"{split_start}:{offset - split_start}")
                    split_start = offset
                    k += 1
                    end = total if k == groups else k * total // groups
    if offset > split_start:
        splits.append(f"{split_start}:{offset - split_start}")
    return rows, (dict(counts) if counts is not None else None), ",".join(splits)


def _write_chunk(f: Any, core: int, lsns: Any, seqs: Any, data: memoryview, starts: Any) -> int:
    """One chunk (``InboxReader.java``'s layout); returns its size in bytes."""
    import numpy as np

    n = len(lsns)
    offsets = np.empty(n + 1, np.int64)
    offsets[:n] = starts
    offsets[n] = len(data)
    f.write(_HEADER.pack(MAGIC, n, core, 0, 0, len(data)))
    for a in (lsns, seqs, offsets):
        a = a.astype(np.int64, copy=False)
        f.write((a if _LITTLE else a.byteswap()).tobytes())
    f.write(data)
    return _HEADER.size + 24 * n + 8 + len(data)


def _array_of(n: int, payloads: bytes | memoryview) -> bytes:
    """The payloads as one msgpack array (array32 header): one decode call."""
    return b"\xdd" + n.to_bytes(4, "big") + payloads


def read(
    spark: Any,
    path: Path,
    splits: str,
    batch_id: int,
    collections: Sequence[str] = (),
    skip: Sequence[int] = (),
) -> Any:
    """The inbox file as a DataFrame of ``frame.INBOX_SCHEMA``'s columns and
    ``new``/``old`` as VARIANT: the reader parses the JSON text from its bytes
    with the session's ``parse_json`` settings (``InboxReader.java``), only
    for rows of ``collections`` (empty: all) whose LSN is not in ``skip``
    (``RowFilter.java``); the others' VARIANTs are NULL."""
    reader = (
        spark.read.format(SOURCE)
        .option("path", str(path))
        .option("splits", splits)
        .option("batch_id", str(batch_id))
        .option("variants", "true")
    )
    if collections:
        if any(ROW_FILTER_SEPARATOR in c for c in collections):
            raise ValueError(f"a collection name holds U+001F: {list(collections)}")
        reader = reader.option("collections", ROW_FILTER_SEPARATOR.join(collections))
    if skip:
        reader = reader.option("skip_lsns", ",".join(str(lsn) for lsn in skip))
    return reader.load()
