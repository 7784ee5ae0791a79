"""Deterministic micro-batches and configs for the Spark tests (and crash subprocesses).

The same arguments always give the same batches (ids, LSNs, rows), in this
process and in a crash subprocess: that is what "a re-run has the same rows"
means for a planner that recorded its plan before running it.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from daemon.config import (
    CdcConfig,
    CdcHandler,
    CdcStream,
    Config,
    DaemonConfig,
    HealthConfig,
    SparkConfig,
)
from daemon.events import StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from wal.record import Record

CORES = 4
COLLECTIONS = ("orders", "users")
BASE_TS_NS = 1_700_000_000_000_000_000


def say(line: str) -> None:
    """Print one protocol line of a worker process to stdout in one ``write(2)``.

    The executor's threads log to the same stdout; ``print`` writes the text and
    its newline separately, so a log line could land between them
    (``committed 21`` + ``2026-11-27 ... [info] ...``). A pipe write of at most
    PIPE_BUF bytes is never split.
    """
    os.write(1, (line + "\n").encode())


def core_of(collection: str, key: str, cores: int = CORES) -> int:
    return zlib.crc32(f"{collection}\0{key}".encode()) % cores


# A payload the CDC writers cannot parse (invalid UTF-8; ingest refuses it).
BAD_NEW = b'{"note":"\xff"}'


def event_for(lsn: int, keys: int = 50, ns_per_lsn: int = 1000, bad_every: int = 0) -> StoredEvent:
    """Event number ``lsn``: a few keys per collection see many updates (order
    tests); with ``bad_every``, every such LSN's ``new`` is ``BAD_NEW``."""
    collection = COLLECTIONS[lsn % len(COLLECTIONS)]
    key = f"k{(lsn * 7919) % keys}"
    op = "insert" if lsn % 5 == 1 else "update"
    new = json.dumps({"amount": lsn * 10 % 2000, "note": "x" * 40, "lsn": lsn}).encode()
    if bad_every and lsn % bad_every == 0:
        new = BAD_NEW
    old = None if op == "insert" else json.dumps({"amount": lsn % 7}).encode()
    ts = BASE_TS_NS + lsn * ns_per_lsn
    # Every third event came from an authenticated producer (the 11-field form).
    return StoredEvent(collection, op, key, new, old, ts, producer=producer_of(lsn))


def producer_of(lsn: int) -> str | None:
    """The producer ``event_for`` names for event ``lsn``."""
    return "orders-svc" if lsn % 3 == 0 else None


def make_batches(
    n_batches: int,
    per_batch: int,
    *,
    first_batch_id: int = 1,
    first_lsn: int = 1,
    cores: int = CORES,
    keys: int = 50,
    ns_per_lsn: int = 1000,
    bad_every: int = 0,
) -> list[MicroBatch]:
    """``n_batches`` consecutive batches of ``per_batch`` events, LSNs from ``first_lsn``;
    event ``lsn`` was ingested at ``BASE_TS_NS + lsn * ns_per_lsn`` (``bad_every``:
    ``event_for``)."""
    batches = []
    seq = dict.fromkeys(range(cores), 0)
    lsn = first_lsn
    for b in range(n_batches):
        per_core: dict[int, list[Record]] = {}
        for _ in range(per_batch):
            ev = event_for(lsn, keys, ns_per_lsn, bad_every)
            c = core_of(ev.collection, ev.key, cores)
            seq[c] += 1
            per_core.setdefault(c, []).append(Record(lsn, c, seq[c], encode(ev)))
            lsn += 1
        slices = {
            c: Slice(c, recs[0].lsn, recs[-1].lsn, recs) for c, recs in sorted(per_core.items())
        }
        batches.append(MicroBatch(first_batch_id + b, slices))
    return batches


def batch_lsns(batches: Sequence[MicroBatch]) -> list[int]:
    return sorted(r.lsn for b in batches for s in b.slices.values() for r in s.records)


def make_config(
    root: Path,
    *,
    streams: Sequence[tuple[str, Sequence[str]]] = (("all", ("*",)),),
    handlers: Sequence[str] = (),
    master: str = "local[2]",
    remote: str = "",
    cores: int = CORES,
    partition_by: Sequence[str] = ("collection",),
    retention_s: int | None = None,
    stream_options: Mapping[str, Any] | None = None,
    attempt_slow_s: float = 600.0,
    daemon_name: str = "",
    tables: Path | None = None,
) -> Config:
    """``stream_options``: more keys of every ``[[cdc.streams]]`` (compaction).

    ``attempt_slow_s``: these tests call the executor directly and check each
    commit's outcome, so by default ``execute`` waits for every commit (it
    stops waiting after half of it, issue 47); a test of a commit handed back
    in flight sets it low. The planner's side of that is tests/core/test_slow_stages.py.

    ``daemon_name``: ``[daemon] name``; ``tables``: the folder of the streams'
    tables (default ``root/cdc``: a shared table's writers name one).
    """
    return Config(
        daemon=DaemonConfig(data_dir=root / "var", cores=cores, name=daemon_name),
        health=HealthConfig(attempt_slow_s=attempt_slow_s),
        spark=SparkConfig(
            master=master,
            remote=remote,
            app_name="eventplane-tests",
            log_level="ERROR",
            conf={"spark.sql.shuffle.partitions": "2"},
            # The tests share one warm session; tests/spark/test_warmup.py turns it on.
            warmup_rows=0,
        ),
        cdc=CdcConfig(
            streams=tuple(
                CdcStream(
                    name,
                    tuple(cols),
                    (tables or root / "cdc") / name,
                    partition_by=tuple(partition_by),
                    retention_s=retention_s,
                    **{"format": "parquet", **(stream_options or {})},
                )
                for name, cols in streams
            ),
            handlers=tuple(CdcHandler(h) for h in handlers),
        ),
    )


def read_table(spark: Any, path: Path) -> list[Any]:
    """Every row a plain reader sees, as Rows (new as JSON text)."""
    df = spark.read.parquet(str(path))
    return df.selectExpr(
        "lsn",
        "core",
        "seq",
        "collection",
        "op",
        "key",
        "to_json(new) AS new",
        "to_json(old) AS old",
        "ingest_ts",
        "batch_id",
    ).collect()


class SharedSession:
    """The shared test session behind a session factory: a session the executor
    "built" and owns, whose stop() must not end the shared one. Detection sees
    the real session through it; ``forget_session`` on it would end the real
    one, so tests that lose it patch that."""

    def __init__(self, spark: Any) -> None:
        self._spark = spark

    def __getattr__(self, name: str) -> Any:
        return getattr(self._spark, name)

    def stop(self) -> None:
        pass


def consistent_arrow_lsns(path: Path) -> list[int]:
    """LSNs a pyarrow reader sees when its dataset discovery runs inside
    ``daemon.snapshot.consistent``, sorted."""
    import pyarrow.dataset as ds

    from daemon.table.snapshot import consistent

    if not any(path.glob("collection=*")):
        return []
    dataset = consistent(path, lambda: ds.dataset(str(path), format="parquet", partitioning="hive"))
    if "lsn" not in dataset.schema.names:
        # No data file yet (a partition's folder comes before its first file):
        # an empty table, which the caller checks against what was committed.
        return []
    return sorted(dataset.to_table(columns=["lsn"]).column("lsn").to_pylist())


def consistent_spark_lsns(spark: Any, path: Path) -> list[int]:
    """LSNs a plain ``spark.read.parquet`` sees when its DataFrame (and so its
    listing) is made inside ``daemon.snapshot.consistent``, sorted."""
    from daemon.table.snapshot import consistent

    if not any(path.glob("collection=*")):
        return []
    df = consistent(path, lambda: spark.read.parquet(str(path)))
    return sorted(r.lsn for r in df.select("lsn").collect())


async def compact_now(ex: Any, stream: str) -> dict[str, Any] | None:
    """Ask the executor's compaction service for a run of ``stream`` now and
    wait (up to 60 s) until it is done; the stream's compaction status then."""
    import asyncio

    assert ex.compaction is not None
    rid = ex.compaction.request(stream)
    assert rid is not None
    for _ in range(600):
        status = ex.compaction.status(stream)
        if status is not None and status["requests_done"] >= rid:
            break
        await asyncio.sleep(0.1)
    status = ex.compaction.status(stream)
    return dict(status) if status is not None else None
