"""Real subprocesses SIGKILLed at each named step of the CDC commit, then recovered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon.table import quarantine
from daemon.table.crash import COMMIT_CRASH_POINTS, ENV_CRASH_AT, REPLAY_CRASH_POINTS
from daemon.table.layout import META_DIR
from daemon.table.ledger import read_ledger
from tests.spark.support import batch_lsns, make_batches

pytestmark = [pytest.mark.spark, pytest.mark.crash]

REPO = Path(__file__).resolve().parents[2]
PER_BATCH = 150
# Every 50th event cannot be written (support.BAD_NEW): each batch sets three
# rows aside in the stream's quarantine, so every step of the commit is reached.
BAD_EVERY = 50

# What a plain reader sees after the kill, before any recovery ran.
BEFORE_RECOVERY = {
    "cdc.before_stage": "batches 1-2",
    "cdc.after_stage": "batches 1-2",
    "cdc.after_quarantine": "batches 1-2",
    "cdc.after_intent": "batches 1-2",
    "cdc.mid_publish": "batches 1-2 and part of 3",
    "cdc.after_publish": "batches 1-3",
    "cdc.after_ledger": "batches 1-3",
    "executor.after_commit": "batches 1-3",
}


def run_worker(
    root: Path,
    *,
    batches: int,
    crash_at: str | None = None,
    master: str = "local[1]",
    remote: str = "",
    timeout: float = 300,
    bad_every: int = 0,
    table_format: str = "parquet",
    s3: str = "",
) -> subprocess.CompletedProcess[str]:
    """``s3``: the table on S3, as crash_worker's ``--s3`` JSON."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable}
    env.pop(ENV_CRASH_AT, None)
    if crash_at:
        env[ENV_CRASH_AT] = crash_at
    cmd = [
        sys.executable,
        "-m",
        "tests.spark.crash_worker",
        str(root),
        "--batches",
        str(batches),
        "--per-batch",
        str(PER_BATCH),
        "--master",
        master,
    ]
    if remote:
        cmd += ["--remote", remote]
    if bad_every:
        cmd += ["--bad-every", str(bad_every)]
    if table_format != "parquet":
        cmd += ["--format", table_format]
    if s3:
        cmd += ["--s3", s3]
    return subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def run_quarantine_worker(
    root: Path, crash_at: str, table_format: str = "parquet"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable}
    env[ENV_CRASH_AT] = crash_at
    return subprocess.run(
        [sys.executable, "-m", "tests.spark.quarantine_worker", str(root), table_format],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def visible(spark: Any, table: Path) -> list[int]:
    if not list(table.glob("collection=*/part-*")):
        return []
    return sorted(r.lsn for r in spark.read.parquet(str(table)).select("lsn").collect())


def test_every_crash_point_is_covered() -> None:
    assert set(BEFORE_RECOVERY) == set(COMMIT_CRASH_POINTS)


@pytest.mark.parametrize("point", COMMIT_CRASH_POINTS)
async def test_sigkill_at_commit_step_recovers_to_exactly_once(
    spark: Any, executor_factory: Any, tmp_path: Path, point: str
) -> None:
    """1. A real executor process commits batches 1-2, then SIGKILLs itself at ``point``
    while committing batch 3; every batch has three rows the writer cannot parse.
    2. Readers see only whole, committed batches (or, from mid-publish on, files of
    a batch whose commit can only roll forward) and never a duplicate.  3. A new
    executor opens the stream (recovery), the planner re-runs batch 3 and runs
    batch 4.  4. Each event is in the table or the quarantine, once, and no staging,
    intent or temp file is left."""
    batches = make_batches(4, PER_BATCH, bad_every=BAD_EVERY)
    table = tmp_path / "cdc" / "all"
    meta = table / META_DIR

    def good(lsns: list[int]) -> list[int]:
        return [lsn for lsn in lsns if lsn % BAD_EVERY]

    def held() -> list[int]:
        return [r.lsn for r in quarantine.load(meta)]

    proc = run_worker(tmp_path, batches=4, crash_at=f"{point}@3", bad_every=BAD_EVERY)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert f"crash point {point} reached (hit 3)" in proc.stderr
    assert "committed 2" in proc.stdout and "committed 3" not in proc.stdout

    seen = visible(spark, table)
    assert len(seen) == len(set(seen))
    one_two, one_three = batch_lsns(batches[:2]), batch_lsns(batches[:3])
    if BEFORE_RECOVERY[point] == "batches 1-2":
        assert seen == good(one_two)
    elif BEFORE_RECOVERY[point] == "batches 1-3":
        assert seen == good(one_three)
    else:
        assert set(good(one_two)) < set(seen) < set(good(one_three))

    ex = await executor_factory()  # restart: recovery runs in start()
    ledger = read_ledger(table)
    assert ledger is not None
    rolled_forward = point not in ("cdc.before_stage", "cdc.after_stage", "cdc.after_quarantine")
    assert ledger.last_batch_id == (3 if rolled_forward else 2)
    done = one_three if rolled_forward else one_two
    assert visible(spark, table) == good(done)
    assert held() == sorted(set(done) - set(good(done)))

    await ex.execute(batches[2])  # the planner re-runs the planned batch
    await ex.execute(batches[3])
    everything = batch_lsns(batches)
    assert visible(spark, table) == good(everything)
    assert held() == sorted(set(everything) - set(good(everything)))
    assert sorted(p.relative_to(meta).as_posix() for p in meta.rglob("*") if p.is_file()) == [
        "generation",
        "ledger.json",
        "lock",
        *(f"quarantine/b{b:012d}.json" for b in (1, 2, 3, 4)),
    ]
    assert not list((meta / "staging").iterdir())


def test_crash_point_fires_at_the_nth_arrival_only(tmp_path: Path) -> None:
    """Without a Spark JVM: the hook itself, in a child process."""
    code = (
        "from daemon.table.crash import crash_point\n"
        "for i in range(1, 4):\n"
        "    crash_point('cdc.after_stage'); crash_point('cdc.after_ledger')\n"
        "    print('passed', i, flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), ENV_CRASH_AT: "cdc.after_ledger@2"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split("\n")[:-1] == ["passed 1"]
    assert "crash point cdc.after_ledger reached (hit 2)" in proc.stderr


@pytest.mark.parametrize("point", REPLAY_CRASH_POINTS)
async def test_sigkill_during_a_quarantine_replay_leaves_each_row_in_one_place(
    spark: Any, executor_factory: Any, tmp_path: Path, point: str
) -> None:
    """1. A real executor process sets rows 3, 6 and 9 aside, then SIGKILLs
    itself at ``point`` while replaying them.  2. Before any recovery the
    quarantine no longer lists rows its pending replay writes back, and a
    reader sees each row at most once.  3. A new executor opens the stream:
    the replay rolls forward.  4. Rows 1-12 are in the table once, the
    quarantine is empty, and no intent or staging is left."""
    from tests.spark import quarantine_worker

    proc = run_quarantine_worker(tmp_path, point)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "committed 1" in proc.stdout and "replayed" not in proc.stdout
    table = tmp_path / "cdc" / "all"
    meta = table / META_DIR
    seen = visible(spark, table)
    assert len(seen) == len(set(seen))
    published = point == "cdc.replay_after_publish"
    rest = [n for n in range(1, quarantine_worker.ROWS + 1) if n not in (3, 6, 9)]
    assert seen == (list(range(1, 13)) if published else rest)
    assert quarantine.load(meta) == []  # a pending replay's rows are the table's

    await executor_factory()  # restart: recovery runs in start()

    assert visible(spark, table) == list(range(1, 13))
    assert quarantine.load(meta) == []
    assert not list((meta / "quarantine").glob("r*.json"))
    assert not list((meta / "staging").iterdir())
