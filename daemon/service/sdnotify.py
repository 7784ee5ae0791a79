"""The systemd notify protocol, spoken directly (sd_notify(3)); no libsystemd.

The protocol is one AF_UNIX datagram per message to the socket named by
``$NOTIFY_SOCKET``, holding newline-separated ``KEY=VALUE`` assignments. A
name starting with ``@`` is a Linux abstract socket (the ``@`` becomes a NUL
byte). When the variable is unset — a terminal, a test, a container without
systemd — every call is a cheap no-op, so callers never branch on it.

What the daemon sends, and when (docs/operating.md, "Start, stop, reload: signals"):

- ``READY=1`` once the WAL is open and both listeners are bound;
- ``STATUS=<one line>`` with a summary (modes, lag), only when it changes;
- ``WATCHDOG=1`` from :class:`Watchdog`, a task on the event loop that pings
  only while ``healthy()`` holds — a stuck loop cannot ping, so systemd
  kills and restarts a daemon whose loop hangs;
- ``RELOADING=1`` + ``MONOTONIC_USEC=`` around a SIGHUP reload, then ``READY=1``;
- ``STOPPING=1`` when the drain begins.

Sending never raises: a lost notification is logged, and the consequence
(systemd's start timeout or watchdog firing) is the safe outcome.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Final

import structlog

from daemon.errors import DaemonError

log = structlog.get_logger("eventplane.sdnotify")

ENV_SOCKET: Final = "NOTIFY_SOCKET"
ENV_WATCHDOG_USEC: Final = "WATCHDOG_USEC"
ENV_WATCHDOG_PID: Final = "WATCHDOG_PID"

# sd_watchdog_enabled(3) recommends pinging at half the timeout: one missed
# tick (a slow GC, a busy loop) still leaves a whole tick of margin.
PING_FRACTION: Final = 0.5
# Without a watchdog, STATUS= is refreshed this often when a status callable is given.
STATUS_ONLY_INTERVAL_S: Final = 5.0


class NotifyError(DaemonError):
    """The watchdog task failed in an unexpected way (a bug, not a lost datagram)."""


def socket_address(value: str | None) -> str | bytes | None:
    """The address to ``sendto`` for a ``$NOTIFY_SOCKET`` value, or None if unusable.

    ``/path`` is a filesystem socket, ``@name`` an abstract one. Other forms
    (systemd 254+ also knows ``vsock:``) are not spoken here and disable
    notifications with a warning rather than failing the start.
    """
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    log.warning("sdnotify.unsupported_socket", notify_socket=value)
    return None


def watchdog_timeout(
    environ: MutableMapping[str, str] | None = None, pid: int | None = None
) -> float | None:
    """systemd's watchdog timeout in seconds for this process, or None when off.

    Like sd_watchdog_enabled(3): ``$WATCHDOG_USEC`` must be a positive integer,
    and when ``$WATCHDOG_PID`` is set it must name this process (a child that
    inherited the variables is not the one being watched).
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_WATCHDOG_USEC, "")
    if not raw.isdigit() or int(raw) == 0:
        return None
    owner = env.get(ENV_WATCHDOG_PID)
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None
    return int(raw) / 1_000_000


def watchdog_interval(
    environ: MutableMapping[str, str] | None = None, pid: int | None = None
) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half the timeout), or None when off."""
    timeout = watchdog_timeout(environ, pid)
    return None if timeout is None else timeout * PING_FRACTION


def _monotonic_usec() -> int:
    # systemd compares this with its own CLOCK_MONOTONIC reading (Type=notify-reload).
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends notify messages to one socket; a no-op when ``address`` is None.

    Thread-safe: the Spark worker thread may report status too.
    """

    def __init__(
        self, address: str | bytes | None = None, watchdog_timeout_s: float | None = None
    ) -> None:
        self.address = address
        self._watchdog_timeout = watchdog_timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._last_status: str | None = None

    @classmethod
    def from_env(
        cls, environ: MutableMapping[str, str] | None = None, *, unset: bool = True
    ) -> Notifier:
        """Read ``$NOTIFY_SOCKET`` and the watchdog variables once.

        With ``unset`` (the default) the variables are removed afterwards, as
        sd_notify(3)'s ``unset_environment`` does, so the Spark JVM, Python
        workers and action subprocesses never inherit them and never talk to
        systemd in our name. Construct one Notifier per process, early.
        """
        env = os.environ if environ is None else environ
        address = socket_address(env.get(ENV_SOCKET))
        timeout = watchdog_timeout(env)
        if unset:
            for name in (ENV_SOCKET, ENV_WATCHDOG_USEC, ENV_WATCHDOG_PID):
                env.pop(name, None)
        return cls(address, timeout if address is not None else None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_timeout(self) -> float | None:
        """The watchdog timeout systemd enforces (``WatchdogSec=``), or None."""
        return self._watchdog_timeout

    def watchdog_interval(self) -> float | None:
        """Seconds between pings (half of ``WatchdogSec=``), or None when off."""
        t = self._watchdog_timeout
        return None if t is None else t * PING_FRACTION

    # -- messages -----------------------------------------------------------

    def ready(self, status: str | None = None) -> bool:
        """Start-up (or a reload) is complete: ``READY=1``."""
        return self._send_with_status(["READY=1"], status)

    def status(self, text: str) -> bool:
        """A one-line human summary shown by ``systemctl status``; sent only on change."""
        line = _one_line(text)
        if line == self._last_status:
            return True
        return self._send_with_status([], line)

    def watchdog(self) -> bool:
        """The keep-alive ping: ``WATCHDOG=1``. Call it through :class:`Watchdog`."""
        return self.send("WATCHDOG=1")

    def reloading(self, status: str | None = None) -> bool:
        """A reload began: ``RELOADING=1`` with ``MONOTONIC_USEC=``; send ready() after."""
        return self._send_with_status(
            ["RELOADING=1", f"MONOTONIC_USEC={_monotonic_usec()}"], status
        )

    def stopping(self, status: str | None = None) -> bool:
        """The drain began: ``STOPPING=1``."""
        return self._send_with_status(["STOPPING=1"], status or "stopping")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the current start/stop timeout fires.

        For a long WAL recovery before READY=1; the stop budget is already
        below ``TimeoutStopSec=`` so shutdown should not need it.
        """
        return self.send(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def send(self, *assignments: str) -> bool:
        """Send raw ``KEY=VALUE`` assignments as one datagram; True when sent."""
        address = self.address
        if address is None or not assignments:
            return False
        payload = "\n".join(assignments).encode()
        try:
            with self._lock:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    # Never block the event loop on a busy PID 1: drop and log instead.
                    sock.setblocking(False)
                    self._sock = sock
                self._sock.sendto(payload, address)
        except OSError as exc:
            log.warning(
                "sdnotify.send_failed",
                message=assignments[0],
                error=str(exc),
                notify_socket=_show(address),
            )
            return False
        return True

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def _send_with_status(self, assignments: list[str], status: str | None) -> bool:
        if status is not None:
            line = _one_line(status)
            assignments = [*assignments, f"STATUS={line}"]
            sent = self.send(*assignments)
            if sent:
                self._last_status = line
            return sent
        return self.send(*assignments)


def _one_line(text: str) -> str:
    # A newline would start a new assignment: STATUS= must stay one line.
    return " ".join(text.split())


def _show(address: str | bytes) -> str:
    if isinstance(address, bytes):
        return "@" + address[1:].decode(errors="replace")
    return address


class Watchdog:
    """Pings ``WATCHDOG=1`` from the event loop while ``healthy()`` holds.

    The ping runs as a task on the loop it watches: if the loop is stuck (a
    blocking call, a deadlock, a runaway coroutine) no ping is sent, and
    systemd kills the process after ``WatchdogSec=`` (SIGABRT; with
    ``PYTHONFAULTHANDLER=1`` in the unit every thread's traceback reaches
    the journal first). If ``healthy()`` is False or raises, pings are
    withheld on purpose — the same restart, with the reason logged.

    ``status``, when given, supplies the ``STATUS=`` line refreshed on each
    tick (sent only when it changed). ``sleep`` and ``clock`` are injectable
    for tests.
    """

    def __init__(
        self,
        notifier: Notifier,
        healthy: Callable[[], bool],
        *,
        interval: float | None = None,
        status: Callable[[], str] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.notifier = notifier
        self._healthy = healthy
        self._status = status
        self._sleep = sleep
        self._clock = clock
        self.interval = interval if interval is not None else notifier.watchdog_interval()
        self.pings = 0
        self._withholding = False
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        """True when systemd asked for pings (``WatchdogSec=``) and can hear them."""
        return self.notifier.enabled and self.interval is not None

    def start(self) -> asyncio.Task[None] | None:
        """Start the ping task on the running loop; None when there is nothing to do."""
        if self._task is not None:
            return self._task
        if not self.notifier.enabled or (self.interval is None and self._status is None):
            log.debug("watchdog.disabled", notify=self.notifier.enabled)
            return None
        log.info("watchdog.started", interval_s=self.interval)
        self._task = asyncio.get_running_loop().create_task(self.run(), name="sd-watchdog")
        return self._task

    async def stop(self) -> None:
        """Cancel the task and wait for it; an earlier failure is re-raised here."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # our caller is being cancelled too: let it propagate

    async def run(self) -> None:
        ping = self.interval is not None
        period = self.interval if self.interval is not None else STATUS_ONLY_INTERVAL_S
        try:
            while True:
                self.tick(ping)
                before = self._clock()
                await self._sleep(period)
                late = self._clock() - before - period
                if late > period:
                    # The loop was blocked longer than a whole tick: the kind of
                    # stall that, a little longer, makes systemd kill us.
                    log.warning("watchdog.loop_stalled", late_s=round(late, 3), tick_s=period)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("watchdog.failed")
            raise NotifyError(f"watchdog task failed: {exc}") from exc

    def tick(self, ping: bool = True) -> bool:
        """One round: refresh STATUS=, ping if healthy. True when a ping was sent."""
        if self._status is not None:
            self.notifier.status(self._status())
        if not ping:
            return False
        if not self._check_health():
            return False
        sent = self.notifier.watchdog()
        if sent:
            self.pings += 1
        return sent

    def _check_health(self) -> bool:
        try:
            ok = bool(self._healthy())
        except Exception:
            # A health check that raises is itself a failure: withholding pings
            # lets systemd restart us, which is what an unhealthy daemon needs.
            # Logged once per unhealthy streak, not on every tick.
            if not self._withholding:
                log.exception("watchdog.health_check_failed")
            ok = False
        if not ok and not self._withholding:
            log.error("watchdog.withheld", reason="unhealthy", interval_s=self.interval)
        elif ok and self._withholding:
            log.info("watchdog.resumed")
        self._withholding = not ok
        return ok
