"""Fixtures for the service tests: a real AF_UNIX datagram socket standing in
for systemd's notify socket, and clean logging state."""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from daemon.service import logs

# struct ucred {pid_t pid; uid_t uid; gid_t gid;} on Linux.
_UCRED = struct.Struct("iII")


@dataclass
class Datagram:
    received_at: float  # time.monotonic() when the reader thread got it
    raw: str
    sender_pid: int | None  # from SCM_CREDENTIALS, as systemd sees it
    fields: dict[str, str] = field(default_factory=dict)


class NotifyReceiver:
    """Binds a datagram socket and records every message from a reader thread.

    A thread (not the event loop under test) reads, so a blocked loop cannot
    hide or delay what was — or was not — sent.
    """

    def __init__(self, address: str | bytes, env_value: str) -> None:
        self.env_value = env_value
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(address)
        self.sock.settimeout(0.02)
        self.datagrams: list[Datagram] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="notify-receiver", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data, ancdata, _flags, _addr = self.sock.recvmsg(
                    4096, socket.CMSG_SPACE(_UCRED.size)
                )
            except TimeoutError:
                continue
            except OSError:
                return
            pid = None
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = _UCRED.unpack(payload[: _UCRED.size])[0]
            text = data.decode()
            fields = dict(line.split("=", 1) for line in text.split("\n") if "=" in line)
            with self._lock:
                self.datagrams.append(Datagram(time.monotonic(), text, pid, fields))

    def messages(self) -> list[Datagram]:
        with self._lock:
            return list(self.datagrams)

    def with_key(self, key: str) -> list[Datagram]:
        return [d for d in self.messages() if key in d.fields]

    def wait_for(
        self, predicate: Callable[[list[Datagram]], bool], timeout: float = 5.0
    ) -> list[Datagram]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = self.messages()
            if predicate(got):
                return got
            time.sleep(0.005)
        raise AssertionError(f"timed out; received {[d.raw for d in self.messages()]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifyReceiver]:
    """An abstract-namespace notify socket, exported as $NOTIFY_SOCKET (``@name``)."""
    name = f"eventplane-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    receiver = NotifyReceiver(b"\0" + name.encode(), "@" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", receiver.env_value)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield receiver
    receiver.close()


@pytest.fixture
def notify_path_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifyReceiver]:
    """A filesystem notify socket (like /run/systemd/notify), short path for sun_path."""
    directory = Path(tempfile.mkdtemp(prefix="ep-", dir="/tmp"))
    path = str(directory / "notify")
    receiver = NotifyReceiver(path, path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield receiver
    receiver.close()
    os.unlink(path)
    directory.rmdir()


@pytest.fixture
def clean_logging() -> Iterator[None]:
    """Whatever a test configures, the next test starts from structlog's defaults."""
    yield
    logs.reset()
