"""Compaction under SIGKILL: at each named step and at random moments, with
readers counting rows all along. Every acknowledged event is seen exactly once
at every observation, before recovery and after it."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from daemon.table.compact import compact_stream
from daemon.table.crash import COMPACT_CRASH_POINTS, ENV_CRASH_AT
from daemon.table.ledger import read_ledger
from tests.spark.support import batch_lsns, consistent_arrow_lsns, make_batches
from tests.spark.test_compact import (
    arrow_lsns,
    compaction_leftovers,
    files_per_partition,
    visible_lsns,
)

pytestmark = [pytest.mark.spark, pytest.mark.crash]

REPO = Path(__file__).resolve().parents[2]
PER_BATCH = 100
ROLLED_FORWARD = {"cdc.compact.after_swap", "cdc.compact.after_ledger", "cdc.compact.mid_clean"}


def worker(root: Path, *args: str, crash_at: str | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable}
    env.pop(ENV_CRASH_AT, None)
    if crash_at:
        env[ENV_CRASH_AT] = crash_at
    cmd = [sys.executable, "-m", "tests.spark.compact_worker", str(root), *args]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_every_compaction_step_has_a_crash_point() -> None:
    assert set(ROLLED_FORWARD) < set(COMPACT_CRASH_POINTS)
    assert all(p.startswith("cdc.compact.") for p in COMPACT_CRASH_POINTS)


# A plain stream, and one partitioned by day: its leaves collection=X/date=D are
# swapped (every event of make_batches is ingested on 2023-11-14, UTC).
LAYOUTS = {"collection": ("collection",), "date": ("collection", "date")}


def leaf(layout: str, collection: str) -> str:
    return f"collection={collection}" + ("/date=2023-11-14" if layout == "date" else "")


# The date layout differs from the plain one in where the folders sit, not in
# the steps: the suite runs it at the points where a nested path matters (the
# last roll-back, the swap, the roll-forward); `make soak` at every point.
DATE_POINTS_IN_SUITE = {
    "cdc.compact.before_swap",
    "cdc.compact.after_swap",
    "cdc.compact.mid_clean",
}
CASES = [
    pytest.param(
        point,
        layout,
        marks=[pytest.mark.soak] if layout == "date" and point not in DATE_POINTS_IN_SUITE else [],
    )
    for point in COMPACT_CRASH_POINTS
    for layout in LAYOUTS
]


@pytest.mark.parametrize(("point", "layout"), CASES)
async def test_sigkill_at_a_compaction_step_keeps_every_row_exactly_once(
    spark: Any, executor_factory: Any, tmp_path: Path, point: str, layout: str
) -> None:
    """1. A real executor process commits batches 1-6, then compacts and SIGKILLs
    itself at ``point`` (first partition).  2. Before any recovery, Spark and
    pyarrow see batches 1-6 exactly once.  3. A new executor opens the stream:
    the compaction rolled forward (after the swap) or back (before it), and no
    compaction folder or intent is left.  4. More batches and a compaction later,
    the table holds batches 1-8 exactly once. For a date-partitioned stream the
    same holds with the leaf folders ``collection=X/date=D`` swapped."""
    partition_by = LAYOUTS[layout]
    batches = make_batches(8, PER_BATCH)
    table = tmp_path / "cdc" / "all"
    proc = worker(
        tmp_path,
        "--batches",
        "6",
        "--per-batch",
        str(PER_BATCH),
        "--partition-by",
        ",".join(partition_by),
        crash_at=point,
    )
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    assert f"crash point {point} reached (hit 1)" in err
    assert "committed 6" in out and "compacted" not in out

    six = batch_lsns(batches[:6])
    assert visible_lsns(spark, table) == six  # a reader before recovery
    assert arrow_lsns(table) == six

    ex = await executor_factory(
        partition_by=partition_by, stream_options={"compaction": False}
    )  # recovery
    ledger = read_ledger(table)
    assert ledger is not None
    forward = point in ROLLED_FORWARD
    assert ledger.last_compaction_id == (1 if forward else 0)
    if forward:
        assert ledger.compactions[-1]["partition"] == leaf(layout, "orders")
    assert files_per_partition(table, partition_by) == {
        leaf(layout, "orders"): 1 if forward else 6,
        leaf(layout, "users"): 6,
    }
    assert compaction_leftovers(table) == []
    assert visible_lsns(spark, table) == six

    for b in batches[6:]:
        await ex.execute(b)
    await asyncio.to_thread(compact_stream, ex.sinks[0], spark, full=True)
    assert files_per_partition(table, partition_by) == {
        leaf(layout, "orders"): 1,
        leaf(layout, "users"): 1,
    }
    assert visible_lsns(spark, table) == batch_lsns(batches)
    assert arrow_lsns(table) == batch_lsns(batches)


class Readers:
    """pyarrow readers of the table in threads, listing through snapshots
    (daemon/table/snapshot.py); each observation is checked against the batches
    acknowledged before it began."""

    def __init__(self, table: Path, batches: list[Any], n: int = 2) -> None:
        self.table = table
        self.batches = batches
        self.acked = 0  # batches the worker acknowledged (committed N printed)
        self.observations = 0
        self.retryable = 0
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(n)]
        self._all = set(batch_lsns(batches))

    def __enter__(self) -> Readers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self) -> None:
        while not self._stop.is_set():
            low = self.acked
            try:
                lsns = consistent_arrow_lsns(self.table) if self.table.is_dir() else []
            except OSError:  # FileNotFoundError: listed before a swap, opened after
                self.retryable += 1
                continue
            self.observations += 1
            got = set(lsns)
            if len(got) != len(lsns):
                self.problems.append(f"{len(lsns) - len(got)} duplicate rows")
            missing = set(batch_lsns(self.batches[:low])) - got
            if missing:
                self.problems.append(f"{len(missing)} acknowledged rows missing")
            if not got <= self._all:
                self.problems.append("rows that were never sent")
            time.sleep(0.02)


@pytest.mark.timeout(900)  # three worker JVMs with --soak; 3 min on a quiet machine
async def test_sigkill_at_random_moments_with_readers_counting_rows(
    spark: Any, executor_factory: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Rounds of: a worker commits batches while its background service compacts
    every 0.05 s (a tier of 3 files is due), SIGKILL at a random moment, then
    recovery in this process. Readers run throughout: no observation ever has a
    duplicate or misses an acknowledged row; after each recovery the table holds
    exactly the committed batches."""
    # One round in the CI suite; three (the full loop) with --soak (make soak).
    rounds = 3 if request.config.getoption("--soak") else 1
    total = 36
    batches = make_batches(total, PER_BATCH)
    table = tmp_path / "cdc" / "all"
    rng = random.Random(int(os.environ.get("EVENTPLANE_TEST_SEED", "15")))
    compactions = 0
    with Readers(table, batches) as readers:
        for _ in range(rounds):
            proc = worker(
                tmp_path, "--batches", str(total), "--per-batch", str(PER_BATCH), "--mode", "loop"
            )
            assert proc.stdout is not None
            ready = threading.Event()

            def follow(stdout: Any = proc.stdout, ready: threading.Event = ready) -> None:
                for line in stdout:
                    if line.startswith("committed "):
                        ready.set()  # the first batch ran: the JVM is warm
                        readers.acked = max(readers.acked, int(line.split()[1]))
                ready.set()  # ended: the assertion below says why

            follower = threading.Thread(target=follow)
            follower.start()
            await asyncio.to_thread(ready.wait, 300)
            assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
            await asyncio.sleep(rng.uniform(2.0, 14.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
            follower.join(60)
            assert proc.stderr is not None
            proc.stderr.close()

            ex = await executor_factory(stream_options={"compaction": False})  # recovery
            ledger = read_ledger(table)
            assert ledger is not None
            assert ledger.last_batch_id >= readers.acked
            assert compaction_leftovers(table) == []
            assert arrow_lsns(table) == batch_lsns(batches[: ledger.last_batch_id])
            assert visible_lsns(spark, table) == batch_lsns(batches[: ledger.last_batch_id])
            compactions = ledger.last_compaction_id
            await ex.stop()
        assert not readers.problems, readers.problems[:5]
    assert readers.observations > 50
    assert compactions >= 2, "the kills should land among compactions"
    print(
        f"rounds {rounds}, acknowledged {readers.acked}, compactions {compactions}, "
        f"observations {readers.observations}, retryable {readers.retryable}"
    )
