"""A lost SparkSession is noticed, forgotten and rebuilt; the failed batch commits once.

The real thing (a driver JVM SIGKILLed, a SparkContext stopped inside a live
JVM) runs in a subprocess, ``tests.spark.jvm_worker``: a process has one
SparkContext, and the shared test session must not be the one that dies. The
other tests use look-alikes of a session, or the shared session wrapped, with
detection faked by ``mock.patch.object`` on :mod:`daemon.spark.session`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from structlog.testing import capture_logs

from daemon.errors import ExecutorError
from daemon.plane.batch import MicroBatch
from daemon.service.metrics import Metrics
from daemon.spark import frame
from daemon.spark import session as sparkmod
from daemon.spark.executor import SparkExecutor
from tests.spark.support import (
    SharedSession,
    batch_lsns,
    make_batches,
    make_config,
    read_table,
)
from triggers.engine import TriggerEngine

pytestmark = pytest.mark.spark

REPO = Path(__file__).resolve().parents[2]
KILLED = "the Spark driver JVM (pid 1) was killed by signal 9"


# -- look-alikes -------------------------------------------------------------------


class _Jsc:
    """``sc._jsc`` (and ``sc._jsc.sc()``): answers isStopped() as told."""

    def __init__(
        self,
        stopped: bool = False,
        error: BaseException | None = None,
        hang: threading.Event | None = None,
    ) -> None:
        self.stopped, self.error, self.hang = stopped, error, hang

    def sc(self) -> _Jsc:
        return self

    def isStopped(self) -> bool:
        if self.hang is not None:
            self.hang.wait(30)
        if self.error is not None:
            raise self.error
        return self.stopped


class _Gateway:
    def __init__(self, proc: subprocess.Popen[bytes] | None) -> None:
        self.proc = proc


class _Sc:
    def __init__(self, jsc: _Jsc | None, proc: subprocess.Popen[bytes] | None = None) -> None:
        self._jsc = jsc
        self._gateway = _Gateway(proc)


class _Classic:
    """A classic session as far as detection looks: ``_sc._jsc``, ``_sc._gateway.proc``."""

    def __init__(self, jsc: _Jsc | None, proc: subprocess.Popen[bytes] | None = None) -> None:
        self._sc = _Sc(jsc, proc)


class _Connect:
    """A Spark Connect session as far as detection looks: ``is_stopped``, ``version``."""

    def __init__(self, stopped: bool = False, error: BaseException | None = None) -> None:
        self.is_stopped, self.error = stopped, error

    @property
    def version(self) -> str:
        if self.error is not None:
            raise self.error
        return "4.2.0"


class _Stage:
    """A SessionAware batch stage that records the sessions it was given."""

    name = "recorder"

    def __init__(self) -> None:
        self.sessions: list[Any] = []
        self.ran: list[tuple[Any, int]] = []

    def on_session(self, spark: Any) -> None:
        self.sessions.append(spark)

    def run_in_spark(self, spark: Any, df: Any, batch: MicroBatch) -> None:
        self.ran.append((spark, batch.batch_id))

    async def finish(self, batch: MicroBatch, result: Any) -> None:
        return None


def _proc(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdin=subprocess.PIPE)


# -- detection ---------------------------------------------------------------------


def test_the_shared_session_is_alive(spark: Any) -> None:
    assert sparkmod.session_exited(spark) is None
    assert sparkmod.probe_session(spark) is None


def test_a_driver_jvm_that_died_is_seen_without_asking_it() -> None:
    killed = _proc("sleep", "60")
    killed.kill()
    killed.wait()
    exited = _proc("true")
    exited.wait()
    assert sparkmod.session_exited(_Classic(_Jsc(), killed)) == (
        f"the Spark driver JVM (pid {killed.pid}) was killed by signal 9"
    )
    assert sparkmod.probe_session(_Classic(_Jsc(), exited)) == (
        f"the Spark driver JVM (pid {exited.pid}) exited with code 0"
    )


def test_a_stopped_context_is_lost_and_a_live_one_is_not() -> None:
    assert sparkmod.session_exited(_Classic(None)) == "the SparkContext was stopped"
    assert sparkmod.session_exited(_Classic(_Jsc(stopped=True))) is None  # needs asking
    assert sparkmod.probe_session(_Classic(_Jsc(stopped=True))) == "the SparkContext was stopped"
    assert sparkmod.probe_session(_Classic(_Jsc())) is None


def test_a_jvm_that_refuses_or_hangs_is_lost_within_the_bound() -> None:
    refused = _Classic(_Jsc(error=ConnectionRefusedError(111, "Connection refused")))
    assert sparkmod.probe_session(refused) == (
        "the Spark driver JVM does not answer (ConnectionRefusedError: [Errno 111] "
        "Connection refused)"
    )
    hang = threading.Event()
    started = time.monotonic()
    try:
        reason = sparkmod.probe_session(_Classic(_Jsc(hang=hang)), timeout_s=0.3)
    finally:
        hang.set()
    assert reason == "the Spark driver JVM did not answer within 0.3 s"
    assert time.monotonic() - started < 5


def test_a_connect_session_is_lost_only_when_the_server_forgot_it() -> None:
    assert sparkmod.session_exited(_Connect(stopped=True), connect=True) == (
        "the Spark Connect session is closed"
    )
    gone = _Connect(error=RuntimeError("[INVALID_HANDLE.SESSION_NOT_FOUND] Session not found"))
    assert sparkmod.probe_session(gone, connect=True) == (
        "the Spark Connect server no longer knows this session (INVALID_HANDLE.SESSION_NOT_FOUND)"
    )
    # A server that is down: the batch retries and the client reconnects later.
    down = _Connect(error=RuntimeError("<_MultiThreadedRendezvous status = UNAVAILABLE>"))
    assert sparkmod.probe_session(down, connect=True) is None
    assert sparkmod.probe_session(_Connect(), connect=True) is None


def test_forgetting_a_session_ends_its_jvm_and_leaves_the_shared_one_alone(spark: Any) -> None:
    """1. A "JVM" that exits at EOF on stdin (PySpark's gateway does) ends when forgotten.
    2. One that ignores it is killed after the bound.  3. The process's real session
    (another context) keeps its gateway and still runs jobs."""
    from pyspark.core.context import SparkContext

    gateway = SparkContext._gateway
    polite = _Classic(_Jsc(), _proc("cat"))
    sparkmod.forget_session(polite, timeout_s=10)
    assert polite._sc._gateway.proc is not None
    assert polite._sc._gateway.proc.returncode == 0 and polite._sc._jsc is None

    stubborn = _Classic(_Jsc(), _proc("sleep", "60"))
    started = time.monotonic()
    sparkmod.forget_session(stubborn, timeout_s=0.3)
    assert stubborn._sc._gateway.proc is not None
    assert stubborn._sc._gateway.proc.returncode == -9
    assert time.monotonic() - started < 5

    assert SparkContext._gateway is gateway
    assert spark.range(3).count() == 3


# -- the executor ------------------------------------------------------------------


async def test_a_lost_session_is_rebuilt_and_the_failed_batch_commits_once(
    spark: Any, tmp_path: Path
) -> None:
    """
    1. Batch 1 commits on the first session.
    2. Batch 2 fails whole (the JVM refuses connections); the probe says the
       JVM died: the executor is not ready, forgets the old session and builds
       a new one, which the stage adopts; the batch's input file is gone.
    3. Batch 2 runs again, same id and rows, on the new session, and commits
       once; status, logs and the metric show one rebuild.
    """
    built: list[Any] = []

    def factory() -> Any:
        built.append(SharedSession(spark))
        return built[-1]

    async def no_sleep(_: float) -> None:
        await asyncio.sleep(0)

    metrics = Metrics()
    stage = _Stage()
    cfg = make_config(tmp_path)
    ex = SparkExecutor(cfg, metrics, [stage], session_factory=factory, sleep=no_sleep)
    await ex.start()
    await asyncio.wait_for(ex.wait_ready(), 60)
    b1, b2 = make_batches(2, 60)
    await ex.execute(b1)  # Step 1

    refused = ConnectionRefusedError(111, "Connection refused")
    with (
        capture_logs() as logs,
        mock.patch.object(frame, "write_inbox", side_effect=refused),
        mock.patch.object(sparkmod, "probe_session", return_value=KILLED) as probe,
        mock.patch.object(sparkmod, "forget_session") as forget,
    ):
        # Step 2. Fails whole; the session is lost.
        with pytest.raises(ExecutorError, match="ConnectionRefusedError"):
            await ex.execute(b2)
        assert not ex.ready() and ex.status()["state"] == "starting"
        assert ex.status()["session_lost"] == KILLED
        await asyncio.wait_for(ex.wait_ready(), 60)
    probe.assert_called_once()
    forget.assert_called_once_with(built[0], False)
    assert len(built) == 2 and stage.sessions == built
    assert not list((cfg.data_dir / "spark-inbox").iterdir())

    # Step 3. The same batch, on the new session, exactly once.
    await ex.execute(b2)
    assert stage.ran == [(built[0], 1), (built[1], 2)]
    status = ex.status()
    assert status["session_rebuilds"] == 1 and status["last_rebuild_at"] is not None
    assert status["session_failures"] == 0 and not ex.needs_restart()
    assert metrics.spark_session_rebuilds._value.get() == 1
    events = {e["event"]: e for e in logs}
    assert events["spark_session_lost"]["reason"] == KILLED
    assert events["spark_session_rebuilt"]["seconds"] >= 0
    lsns = [r.lsn for r in read_table(spark, cfg.cdc.streams[0].path)]
    assert sorted(lsns) == batch_lsns([b1, b2])
    await ex.stop()


async def test_needs_restart_after_failed_rebuilds_in_a_row_and_not_after_a_success(
    spark: Any, tmp_path: Path
) -> None:
    """
    1. The JVM is seen dead before a batch starts: the batch fails at once.
    2. The rebuild fails ``health.session_restart_attempts`` (5) times in a row,
       with the start-up backoff: needs_restart() turns true.
    3. The next build succeeds: ready again, needs_restart() false, the count
       of failures back to 0.
    """
    calls: list[int] = []
    release, seventh = threading.Event(), threading.Event()
    sleeps: list[float] = []

    def factory() -> Any:
        calls.append(len(calls) + 1)
        if len(calls) == 1:
            return SharedSession(spark)
        if len(calls) <= 6:
            raise RuntimeError("Java gateway process exited before sending its port number")
        seventh.set()
        release.wait(30)
        return SharedSession(spark)

    async def fake_sleep(s: float) -> None:
        sleeps.append(s)
        await asyncio.sleep(0)

    ex = SparkExecutor(make_config(tmp_path), Metrics(), session_factory=factory, sleep=fake_sleep)
    await ex.start()
    await asyncio.wait_for(ex.wait_ready(), 60)
    (batch,) = make_batches(1, 20)
    with (
        mock.patch.object(sparkmod, "session_exited", side_effect=[KILLED]),
        mock.patch.object(sparkmod, "forget_session"),
    ):
        # Step 1
        with pytest.raises(ExecutorError, match="the Spark session was lost"):
            await ex.execute(batch)
        # Step 2
        assert await asyncio.to_thread(seventh.wait, 30)
        status = ex.status()
        assert status["session_failures"] == 5 and ex.needs_restart()
        assert not ex.ready() and "Java gateway process exited" in status["session_error"]
        assert sleeps == [0.5, 1.0, 2.0, 4.0, 8.0]
        # Step 3
        release.set()
        await asyncio.wait_for(ex.wait_ready(), 30)
    status = ex.status()
    assert not ex.needs_restart() and status["session_failures"] == 0
    assert status["session_attempts"] == 6 and status["session_rebuilds"] == 1
    await ex.execute(batch)
    await ex.stop()


def test_the_trigger_engine_drops_what_it_made_from_the_old_session(tmp_path: Path) -> None:
    engine = TriggerEngine([], data_dir=tmp_path)
    old, new = object(), object()
    engine.on_session(old)
    engine._selection = mock.sentinel.selection
    engine._validated = True
    engine.on_session(old)  # the same session: keep everything
    assert engine._selection is mock.sentinel.selection and engine._validated
    engine.on_session(new)
    assert engine._spark is new and engine._selection is None and not engine._validated


# -- the real thing ------------------------------------------------------------------


@pytest.mark.crash
@pytest.mark.timeout(900)
def test_killed_jvm_and_stopped_context_are_rebuilt_and_batches_commit_once(
    spark: Any, tmp_path: Path
) -> None:
    """``tests.spark.jvm_worker`` (module docstring): a SIGKILLed driver JVM, then a
    SparkContext stopped inside a live JVM; each time a new JVM, the old one gone,
    and the failed batch committed once."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.spark.jvm_worker", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [s["step"] for s in steps] == [1, 2, 3], proc.stdout
    _, killed, stopped = steps
    assert len({s["pid"] for s in steps}) == 3
    assert killed["old_pid_gone"] and stopped["old_pid_gone"]
    assert "was killed by signal 9" in killed["status"]["session_lost"]
    assert stopped["status"]["session_lost"] == "the SparkContext was stopped"
    assert stopped["status"]["session_rebuilds"] == 2
    assert len(killed["errors"]) == 1 and len(stopped["errors"]) == 1
    lsns = [r.lsn for r in read_table(spark, tmp_path / "cdc" / "all")]
    assert sorted(lsns) == batch_lsns(make_batches(3, 150))
    assert not list((tmp_path / "var" / "spark-inbox").iterdir())
    print(f"rebuilt after SIGKILL in {killed['seconds']} s, after a stopped context in "
          f"{stopped['seconds']} s (failure to commit)")  # fmt: skip
