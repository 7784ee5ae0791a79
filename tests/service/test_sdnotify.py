"""The notify protocol against a real AF_UNIX datagram socket set as NOTIFY_SOCKET."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from structlog.testing import capture_logs

from daemon.service import sdnotify
from daemon.service.sdnotify import Notifier, Watchdog
from tests.service.conftest import NotifyReceiver


def test_ready_status_and_stopping_arrive_on_an_abstract_socket(
    notify_socket: NotifyReceiver,
) -> None:
    n = Notifier.from_env()
    assert n.enabled
    assert n.ready("serving")
    assert n.status("normal 4 · max lag 0")
    assert n.stopping()
    got = notify_socket.wait_for(lambda d: len(d) == 3)
    assert got[0].raw == "READY=1\nSTATUS=serving"
    assert got[1].fields == {"STATUS": "normal 4 · max lag 0"}
    assert got[2].fields["STOPPING"] == "1"
    n.close()


def test_filesystem_socket_path_is_spoken_too(notify_path_socket: NotifyReceiver) -> None:
    n = Notifier.from_env()
    assert n.ready()
    got = notify_path_socket.wait_for(lambda d: len(d) == 1)
    assert got[0].fields == {"READY": "1"}
    assert got[0].sender_pid == os.getpid()
    n.close()


def test_without_notify_socket_every_call_is_a_silent_noop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    n = Notifier.from_env()
    assert not n.enabled
    assert n.watchdog_interval() is None  # a watchdog nobody can hear is off
    with capture_logs() as logs:
        assert not n.ready()
        assert not n.status("x")
        assert not n.watchdog()
        assert not n.reloading()
        assert not n.stopping()
    assert logs == []


def test_from_env_unsets_the_variables_so_children_do_not_inherit_them(
    notify_socket: NotifyReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier.from_env()
    assert n.watchdog_timeout() == 10.0
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        assert name not in os.environ
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('NOTIFY_SOCKET'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.strip() == "None"  # the Spark JVM would see the same


def test_status_is_kept_on_one_line_and_sent_only_when_it_changes(
    notify_socket: NotifyReceiver,
) -> None:
    n = Notifier.from_env()
    n.status("cores:\nnormal 3\nREADY=1")  # a newline must not smuggle in READY=1
    n.status("cores: normal 3 READY=1")  # same line after folding: not sent again
    n.status("cores: normal 4")
    n.watchdog()  # a marker: everything before it has arrived
    got = notify_socket.wait_for(lambda d: any("WATCHDOG" in x.fields for x in d))
    statuses = [d.fields["STATUS"] for d in got if "STATUS" in d.fields]
    assert statuses == ["cores: normal 3 READY=1", "cores: normal 4"]
    assert not any("READY" in d.fields for d in got)


def test_reloading_carries_monotonic_usec_then_ready_ends_the_reload(
    notify_socket: NotifyReceiver,
) -> None:
    n = Notifier.from_env()
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    n.reloading("reloading triggers")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    n.ready("serving")
    got = notify_socket.wait_for(lambda d: len(d) == 2)
    assert got[0].fields["RELOADING"] == "1"
    assert before <= int(got[0].fields["MONOTONIC_USEC"]) <= after
    assert got[0].fields["STATUS"] == "reloading triggers"
    assert got[1].fields["READY"] == "1"


def test_extend_timeout_is_sent_in_microseconds(notify_socket: NotifyReceiver) -> None:
    Notifier.from_env().extend_timeout(90)
    got = notify_socket.wait_for(lambda d: len(d) == 1)
    assert got[0].fields == {"EXTEND_TIMEOUT_USEC": "90000000"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "<self>"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # someone else's
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_is_half_the_timeout_and_only_for_this_pid(
    env: dict[str, str], expected: float | None
) -> None:
    env = {k: (str(os.getpid()) if v == "<self>" else v) for k, v in env.items()}
    assert sdnotify.watchdog_interval(env) == expected


def test_a_send_failure_is_logged_and_never_raised(tmp_path: os.PathLike[str]) -> None:
    n = Notifier(str(tmp_path) + "/nobody-listens")
    with capture_logs() as logs:
        assert n.ready() is False
    assert logs[0]["event"] == "sdnotify.send_failed"
    assert logs[0]["message"] == "READY=1"


def test_unsupported_socket_kinds_disable_notifications_with_a_warning() -> None:
    with capture_logs() as logs:
        n = Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not n.enabled
    assert logs[0]["event"] == "sdnotify.unsupported_socket"


def test_the_main_process_itself_sends_as_notifyaccess_main_requires(
    notify_socket: NotifyReceiver,
) -> None:
    """A real child process (as systemd starts it) reports READY=1 and pings;
    the kernel-attested sender pid is that process, not a helper of it."""
    code = (
        "from daemon.service.sdnotify import Notifier\n"
        "n = Notifier.from_env()\n"
        "n.ready('up'); n.watchdog(); n.stopping()\n"
    )
    env = dict(os.environ, NOTIFY_SOCKET=notify_socket.env_value)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    assert proc.wait(timeout=30) == 0
    got = notify_socket.wait_for(lambda d: len(d) == 3)
    assert [next(iter(d.fields)) for d in got] == ["READY", "WATCHDOG", "STOPPING"]
    assert {d.sender_pid for d in got} == {proc.pid}


# -- the watchdog task ---------------------------------------------------------


async def test_watchdog_pings_while_healthy_and_withholds_while_not(
    notify_socket: NotifyReceiver,
) -> None:
    """1. healthy: pings arrive every interval.
    2. unhealthy: no ping arrives, and the reason is logged once.
    3. healthy again: pings resume."""
    healthy = True
    dog = Watchdog(Notifier.from_env(), healthy=lambda: healthy, interval=0.01)
    with capture_logs() as logs:
        dog.start()
        await _until(lambda: len(notify_socket.with_key("WATCHDOG")) >= 3)
        healthy = False
        await asyncio.sleep(0.03)  # let an in-flight tick finish
        withheld_at = len(notify_socket.with_key("WATCHDOG"))
        await asyncio.sleep(0.1)
        assert len(notify_socket.with_key("WATCHDOG")) == withheld_at
        healthy = True
        await _until(lambda: len(notify_socket.with_key("WATCHDOG")) > withheld_at)
        await dog.stop()
    events = [e["event"] for e in logs]
    assert events.count("watchdog.withheld") == 1
    assert "watchdog.resumed" in events


async def test_a_stuck_event_loop_sends_no_watchdog_ping(notify_socket: NotifyReceiver) -> None:
    """1. The watchdog pings every 20 ms from the loop.
    2. The loop is blocked for 0.6 s (a synchronous call gone wrong).
    3. No ping arrives during the block (a thread-based pinger would send ~30),
       a stall warning is logged, and pings resume once the loop runs again."""
    dog = Watchdog(Notifier.from_env(), healthy=lambda: True, interval=0.02)
    with capture_logs() as logs:
        dog.start()
        await _until(lambda: len(notify_socket.with_key("WATCHDOG")) >= 3)
        blocked_from = time.monotonic()
        time.sleep(0.6)  # noqa: ASYNC251 - the stuck loop is the point of the test
        blocked_until = time.monotonic()
        await _until(lambda: notify_socket.with_key("WATCHDOG")[-1].received_at > blocked_until)
        await dog.stop()
    # 0.1 s of slack for a ping sent just before the block but read a little later.
    during = [
        d
        for d in notify_socket.with_key("WATCHDOG")
        if blocked_from + 0.1 < d.received_at < blocked_until
    ]
    assert during == []
    stalls = [e for e in logs if e["event"] == "watchdog.loop_stalled"]
    assert stalls and stalls[0]["late_s"] >= 0.5


async def test_a_health_check_that_raises_counts_as_unhealthy(
    notify_socket: NotifyReceiver,
) -> None:
    def broken() -> bool:
        raise RuntimeError("plane status unavailable")

    dog = Watchdog(Notifier.from_env(), healthy=broken, interval=0.01)
    with capture_logs() as logs:
        dog.start()
        await asyncio.sleep(0.1)
        await dog.stop()
    assert notify_socket.with_key("WATCHDOG") == []
    events = [e["event"] for e in logs]
    assert events.count("watchdog.health_check_failed") == 1  # once, not every tick
    assert events.count("watchdog.withheld") == 1
    assert dog.pings == 0


async def test_watchdog_is_off_without_watchdog_usec(notify_socket: NotifyReceiver) -> None:
    dog = Watchdog(Notifier.from_env(), healthy=lambda: True)
    assert dog.interval is None
    assert not dog.enabled
    assert dog.start() is None
    await dog.stop()  # stopping a watchdog that never started is fine


async def test_watchdog_uses_half_of_watchdog_usec(
    notify_socket: NotifyReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "40000")  # 40 ms -> a ping every 20 ms
    dog = Watchdog(Notifier.from_env(), healthy=lambda: True)
    assert dog.interval == pytest.approx(0.02)
    dog.start()
    await _until(lambda: len(notify_socket.with_key("WATCHDOG")) >= 3)
    await dog.stop()


async def test_watchdog_refreshes_status_with_the_ping(notify_socket: NotifyReceiver) -> None:
    lag = [5]
    dog = Watchdog(
        Notifier.from_env(), healthy=lambda: True, interval=0.01, status=lambda: f"lag {lag[0]}"
    )
    dog.start()
    await _until(lambda: len(notify_socket.with_key("WATCHDOG")) >= 2)
    lag[0] = 0
    await _until(lambda: any(d.fields.get("STATUS") == "lag 0" for d in notify_socket.messages()))
    await dog.stop()
    statuses = [d.fields["STATUS"] for d in notify_socket.with_key("STATUS")]
    assert statuses == ["lag 5", "lag 0"]  # refreshed each tick, sent only on change


async def test_watchdog_tick_is_testable_without_a_clock(notify_socket: NotifyReceiver) -> None:
    dog = Watchdog(Notifier.from_env(), healthy=lambda: True, interval=15.0)
    assert dog.tick() is True
    assert dog.pings == 1
    got = notify_socket.wait_for(lambda d: len(d) == 1)
    assert got[0].fields == {"WATCHDOG": "1"}


async def _until(condition: Callable[[], bool]) -> None:
    # Polling on purpose: the condition is fed by the receiver thread, not the loop.
    async with asyncio.timeout(5.0):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)
