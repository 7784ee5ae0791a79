"""A Delta commit of Parquet files already written, without a Spark job.

The direct write (``DirectWrite.java``) writes a batch's Parquet files in the
driver JVM; this module commits them to the stream's Delta table with delta-rs
(the ``deltalake`` package): one commit with an ``add`` action per file, the
stream's ``txn`` (app id, batch id) and ``userMetadata``. A Spark append
commits the same actions, after a Spark job and a log replay that cost about
a second per batch (docs/cdc.md, "Table formats: Delta Lake or Parquet").

Each ``add`` carries the file's statistics, read from its Parquet footer:
``numRecords``, and ``nullCount``/``minValues``/``maxValues`` of the columns
readers filter by (``STATS_COLUMNS``), only where the footer holds an exact
bound: a string longer than ``STRING_STATS_CHARS`` gets no maximum, a
timestamp's bounds are widened to whole milliseconds (Delta's precision).
A reader skips a file only on those bounds, so a missing one costs a read,
never a row.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

# Delta Spark keeps a string's first 32 characters as its bound.
STRING_STATS_CHARS = 32
# The commitInfo field naming the daemon process that committed (delta.py:
# a writer tells its own commits from a new writer's by it).
WRITER_KEY = "eventplaneWriter"
# The commitInfo field naming the daemon ([daemon] name) in a shared table: a
# writer checks only the commits of its own name (delta.py, fence.py).
NAME_KEY = "eventplaneName"


def available() -> str | None:
    """Why a batch cannot be committed without Spark here (None: it can)."""
    try:
        import deltalake  # noqa: F401
    except ImportError as exc:  # the package is a dependency: a broken install
        return f"the deltalake package does not import ({exc})"
    return None


def partition_values(rel: str) -> dict[str, str]:
    """``{"collection": "orders", "date": ...}`` of a file's relative path."""
    out: dict[str, str] = {}
    for part in Path(rel).parts[:-1]:
        name, sep, value = part.partition("=")
        if sep:
            out[name] = unquote(value)
    return out


def file_stats(path: Path, columns: Iterable[str]) -> str:
    """The Delta statistics (JSON text) of one Parquet file (module doc)."""
    import pyarrow.parquet as pq

    meta = pq.read_metadata(path)
    leaves = {meta.schema.column(i).path: i for i in range(meta.num_columns)}
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for name in columns:
        i = leaves.get(name)
        if i is None:
            continue
        bounds = _column_bounds(meta, i)
        if bounds is None:
            continue
        nulls[name], lo, hi = bounds
        if lo is not None and hi is not None:
            lo, hi = _json_bound(lo, down=True), _json_bound(hi, down=False)
            if lo is not None and hi is not None:
                mins[name], maxs[name] = lo, hi
    stats = {"numRecords": meta.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls}
    return json.dumps(stats, separators=(",", ":"))


def _column_bounds(meta: Any, i: int) -> tuple[int, Any, Any] | None:
    """(null count, min, max) of leaf column ``i`` over every row group; None
    where a row group has no statistics; min/max None where some group has
    only nulls or no bounds."""
    nulls = 0
    lo: Any = None
    hi: Any = None
    exact = True
    for g in range(meta.num_row_groups):
        chunk = meta.row_group(g).column(i)
        st = chunk.statistics
        if st is None or not st.has_null_count:
            return None
        nulls += st.null_count
        if not st.has_min_max:
            if st.null_count < chunk.num_values:  # values, but no bounds for them
                exact = False
            continue
        lo = st.min if lo is None else min(lo, st.min)
        hi = st.max if hi is None else max(hi, st.max)
    return (nulls, lo, hi) if exact else (nulls, None, None)


def _json_bound(value: Any, *, down: bool) -> Any:
    """``value`` as Delta stores a bound, rounded outwards; None: no exact bound."""
    if isinstance(value, int):  # bool too
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        if len(value) <= STRING_STATS_CHARS:
            return value
        return value[:STRING_STATS_CHARS] if down else None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        value = value.astimezone(dt.UTC)
        micros = value.microsecond % 1000
        value = value - dt.timedelta(microseconds=micros)
        if micros and not down:
            value += dt.timedelta(milliseconds=1)
        return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"
    return None


def add_action(file: Path, rel: str, stats_columns: Iterable[str]) -> Any:
    """The ``add`` action of the Parquet file ``file`` (written, not yet
    committed), to be the table's file ``rel``."""
    from deltalake.transaction import AddAction

    st = os.stat(file)
    return AddAction(
        quote(rel, safe="/="),
        st.st_size,
        partition_values(rel),
        st.st_mtime_ns // 1_000_000,
        True,
        file_stats(file, stats_columns),
    )


def commit(
    table: Any,
    actions: list[Any],
    *,
    partition_by: list[str],
    user_metadata: Mapping[str, Any],
    app_id: str | None = None,
    version: int = 0,
    writer: str | None = None,
    name: str | None = None,
    retries: int | None = None,
) -> None:
    """One blind append of ``actions`` to the delta-rs table ``table``, with
    ``userMetadata`` and, given ``app_id``, the ``txn`` (``app_id``, ``version``);
    given ``writer``, its identity in commitInfo (``WRITER_KEY``; ``name``, the
    daemon's in a shared table: ``NAME_KEY``). ``retries``
    0: a commit whose version another took fails (``CommitFailedError``)
    instead of being rebased onto it (None: delta-rs's default)."""
    from deltalake import CommitProperties, PostCommitHookProperties, Transaction

    txns = [Transaction(app_id, version, int(time.time() * 1000))] if app_id else None
    custom = {"userMetadata": json.dumps(user_metadata, separators=(",", ":"))}
    if writer is not None:
        custom[WRITER_KEY] = writer
    if name:
        custom[NAME_KEY] = name
    properties = CommitProperties(
        custom_metadata=custom, max_commit_retries=retries, app_transactions=txns
    )
    table.create_write_transaction(
        actions,
        "append",
        table.schema(),
        partition_by=partition_by,
        commit_properties=properties,
        # Expired log entries go in the compaction thread (cleanup_metadata):
        # after each commit, delta-rs would list the whole _delta_log (on S3,
        # one LIST per 1,000 entries, 30 days of them by default).
        post_commithook_properties=PostCommitHookProperties(cleanup_expired_logs=False),
    )
