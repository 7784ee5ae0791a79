"""Start, load and kill real daemon subprocesses on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import cds
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
# [spark] keys of every test daemon (write_config).
TEST_SPARK_LINES = "warmup_rows = 0\nclass_sharing = false\n"


# A test daemon calls an attempt slow after 30 s, not the shipped 5 s: beside the
# suite's other workers a first batch can take 15 s on 2 cores, and only the tests
# of slow stages (tests/faults/test_s3_hang.py, ...) are about that; they set
# their own `attempt_slow_s`, which this leaves alone.
TEST_ATTEMPT_SLOW_S = 30


def _test_health(config: Path) -> None:
    """Give ``config`` the test daemons' ``[health] attempt_slow_s`` unless it sets one."""
    text = config.read_text()
    if "attempt_slow_s" in text:
        return
    config.write_text(add_to_table(text, "health", f"attempt_slow_s = {TEST_ATTEMPT_SLOW_S}"))


def add_to_table(text: str, table: str, line: str) -> str:
    """Config ``text`` with ``line`` first in its ``[table]`` (added at the end if absent)."""
    header = f"\n[{table}]\n"
    if header in text:
        return text.replace(header, header + line + "\n", 1)
    return text + header + line + "\n"


def write_config(directory: Path, extra: str = "", **daemon: Any) -> Path:
    """A config on free ports with data under ``directory/data``.

    ``ingest=`` and ``wal=`` take extra lines for those tables (TOML cannot
    reopen a table, so ``extra`` cannot add to them).
    """
    cores = daemon.get("cores", 4)
    text = f"""
[daemon]
data_dir = "data"
cores = {cores}
shutdown_timeout_s = {daemon.get("shutdown_timeout_s", 10.0)}

[ingest]
listen = "127.0.0.1:{free_port()}"
{daemon.get("ingest", "")}

[admin]
listen = "127.0.0.1:{free_port()}"

[wal]
segment_bytes = {daemon.get("segment_bytes", 1 << 20)}
{daemon.get("wal", "")}

[microbatch]
interval_ms = {daemon.get("interval_ms", 100)}

[log]
format = "json"
level = "{daemon.get("log_level", "info")}"
{extra}
"""
    # The test daemons start as they did before the warm-up write and class data
    # sharing existed: each has a data_dir of its own, where every JVM would
    # record a 170 MB archive at its exit (tests/spark/test_warmup.py and
    # tests/spark/test_session_conf.py cover both).
    if "\n[spark]\n" in text:
        text = text.replace("\n[spark]\n", "\n[spark]\n" + TEST_SPARK_LINES, 1)
    else:
        text += "\n[spark]\n" + TEST_SPARK_LINES
    path = directory / "config.toml"
    path.write_text(text)
    return path


def webhook_trigger(name: str, when: str, url: str, collection: str = "orders") -> str:
    """One ``[[triggers]]`` table (inserts only) calling ``url``."""
    return f"""
[[triggers]]
name = "{name}"
collection = "{collection}"
on = ["insert"]
when = "{when}"
action = {{ type = "webhook", url = "{url}" }}
"""


@dataclass
class DaemonProcess:
    """One daemon subprocess; ``argv`` picks the entry (production or recording)."""

    config: Path
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    ingest_url: str = ""
    admin_url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    # What start() waits for to answer 200: a standby is never ready, but healthy.
    ready_path: str = "/readyz"

    @classmethod
    def production(cls, config: Path, **kw: Any) -> DaemonProcess:
        argv = [sys.executable, "-m", "daemon.cli.main", "run", "--config", str(config)]
        return cls(config, argv, config.parent / "daemon.log", **kw)

    @classmethod
    def recording(cls, config: Path, record: Path, **kw: Any) -> DaemonProcess:
        argv = [
            sys.executable,
            "-m",
            "tests.integration.recording_daemon",
            str(config),
            str(record),
        ]
        return cls(config, argv, config.parent / "daemon.log", **kw)

    def start(self, timeout_s: float = 60.0) -> DaemonProcess:
        import tomllib

        _test_health(self.config)
        cds.add_to_config(self.config)  # the run's JVM archive, once it is recorded
        cfg = tomllib.loads(self.config.read_text())
        self.ingest_url = f"http://{cfg['ingest']['listen']}"
        self.admin_url = f"http://{cfg['admin']['listen']}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        if "NOTIFY_SOCKET" not in self.env:  # only a test that asks talks to a notify socket
            env.pop("NOTIFY_SOCKET", None)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.admin_url + self.ready_path, timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"daemon not ready after {timeout_s}s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def status(self) -> dict[str, Any]:
        # 15 s: a status answer waits for the loop, which a loaded machine can hold
        # for seconds (seen once in tests/faults/test_restore.py at 5 s).
        with urllib.request.urlopen(self.admin_url + "/v1/status", timeout=15) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def post_events(url: str, events: list[dict[str, Any]], timeout: float = 30.0) -> dict[str, Any]:
    body = b"\n".join(json.dumps(e).encode() for e in events) + b"\n"
    req = urllib.request.Request(
        url + "/v1/events",
        data=body,
        method="POST",
        headers={"Content-Type": "application/x-ndjson"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def make_events(start: int, n: int, collections: int = 3, keys: int = 50) -> list[dict[str, Any]]:
    return [
        {
            "collection": f"c{i % collections}",
            "op": "insert" if i % 5 else "update",
            "key": f"k{i % keys}",
            "new": {"i": i, "amount": i % 2000, "pad": "x" * 60},
            "old": None if i % 5 else {"i": i - 1},
        }
        for i in range(start, start + n)
    ]


class Loader(threading.Thread):
    """Producers posting until stopped or refused; every ack's LSN range is kept.

    The acked list is the ground truth of crash tests: what the daemon
    acknowledged must survive any SIGKILL.
    """

    def __init__(
        self, url: str, batch: int = 200, producers: int = 4, pause_s: float = 0.0
    ) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.pause_s = pause_s
        self.batch = batch
        self.producers = producers
        self.acked: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self.errors = 0

    def _produce(self, pid: int) -> None:
        i = pid * 10_000_000
        while not self._halt.is_set():
            try:
                resp = post_events(self.url, make_events(i, self.batch), timeout=10)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                self.errors += 1
                if self._halt.wait(0.05):
                    return
                continue
            with self._lock:
                self.acked.append((resp["first_lsn"], resp["last_lsn"]))
            i += self.batch
            if self.pause_s and self._halt.wait(self.pause_s):
                return

    def run(self) -> None:
        threads = [
            threading.Thread(target=self._produce, args=(p,), daemon=True)
            for p in range(self.producers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)

    def acked_lsns(self) -> set[int]:
        with self._lock:
            return {lsn for a, b in self.acked for lsn in range(a, b + 1)}


@dataclass
class Delivery:
    batch_id: int
    rows: list[tuple[int, int]]  # (lsn, core) in the order the executor saw them


def read_record(path: Path) -> list[Delivery]:
    """Every execute() call recorded by FileRecordingExecutor, in order."""
    if not path.exists():
        return []
    out: list[Delivery] = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if parts[0] == "B":
            out.append(Delivery(int(parts[1]), []))
        else:
            out[-1].rows.append((int(parts[0]), int(parts[1])))
    return out
