"""One class data sharing archive for the driver JVMs of the suite's daemons.

Each test daemon boots Spark's JVM, and the suite boots well over a hundred.
A JVM that maps Spark's classes from a class data sharing archive boots on
about two thirds of the CPU (docs/performance.md, "The daemon's JVM"); one
archive per daemon (``[spark] class_sharing``) would cost more than it saves
(each JVM writes 170 MB at its exit). So the first worker of a large run
records one archive with a real daemon in the run's shared temp folder
(:class:`Recorder`, about 30 s) while the others wait for it (:func:`wait`);
then every daemon maps it through ``-XX:SharedArchiveFile`` in its
``[spark.conf]`` (:func:`add_to_config`, called by ``DaemonProcess.start``).
Daemons whose JVM options are their own boot as before, and so does every
daemon if the recording failed. A JVM whose class path does not match the
archive's maps nothing and runs as it would without it.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import IO, Any

# The run's shared folder (set by tests/conftest.py, the same in every worker).
ENV = "EVENTPLANE_TEST_CDS_DIR"
READY = "cds-ready"  # holds the archive's path once it maps
FAILED = "cds-failed"  # holds why there is none
# A run of fewer tests does not record (the recording costs about 40 CPU-seconds).
MIN_TESTS = 200


def archive() -> Path | None:
    """The run's archive, once recorded and checked; None before (or never)."""
    root = os.environ.get(ENV)
    if not root:
        return None
    try:
        path = Path((Path(root) / READY).read_text().strip())
    except OSError:
        return None
    return path if path.is_file() else None


def wait(root: Path, timeout_s: float = 300.0) -> str:
    """Wait while another worker records the run's archive; what went wrong, if anything."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (root / READY).exists():
            return ""
        if (root / FAILED).exists():
            return (root / FAILED).read_text()
        time.sleep(0.5)
    return f"no archive within {timeout_s:.0f} s"


def add_to_config(config: Path) -> None:
    """Give ``config``'s driver JVM the run's archive, unless it has none yet,
    the config sets JVM options or a driver memory of its own (another heap
    layout), or its Spark is remote."""
    jsa = archive()
    if jsa is None:
        return
    text = config.read_text()
    if "\n[spark]\n" not in text or any(
        word in text for word in ("extraJavaOptions", "spark.driver.memory", "remote =")
    ):
        return
    from tests.integration.harness import add_to_table

    line = f'"spark.driver.extraJavaOptions" = "-XX:SharedArchiveFile={jsa} -Xlog:cds*=off"'
    config.write_text(add_to_table(text, "spark.conf", line))


def _writing(path: Path) -> bool:
    """Whether a live process was started to write ``path`` (a JVM records its
    archive as it exits, after the daemon that started it has exited)."""
    needle = str(path).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


class Recorder:
    """Records the run's archive with a real daemon under ``root``: a first
    life writes it at the JVM's exit, a second checks that it maps (the
    daemon's own ``class_sharing``, step 2) and keeps it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock: IO[str] | None = None

    def claim(self) -> bool:
        """Whether this process records (the first worker to ask, once per run)."""
        if (self.root / READY).exists() or (self.root / FAILED).exists():
            return False
        self._lock = (self.root / "cds.lock").open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        return not (self.root / "cds-recorder").exists()

    def record(self) -> str:
        """Record the archive; what went wrong, if anything (the suite then runs without)."""
        try:
            self._record()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            (self.root / FAILED).write_text(error)
            return error
        return ""

    def _life(self, config: Path) -> None:
        from tests.integration.harness import DaemonProcess

        daemon = DaemonProcess.production(config).start(timeout_s=300)
        try:
            self._commit_and_stop(daemon)
        finally:
            if daemon.proc is not None and daemon.proc.poll() is None:
                daemon.kill()

    @staticmethod
    def _commit_and_stop(daemon: Any) -> None:
        from tests.integration.harness import make_events, post_events

        deadline = time.monotonic() + 300
        for i in range(3):
            post_events(daemon.ingest_url, make_events(i * 200, 200))
        while time.monotonic() < deadline:
            st = daemon.status()
            if st["spark"]["ready"] and all(s["batch_id"] >= 1 for s in st["stages"]):
                break
            time.sleep(0.2)
        else:
            raise TimeoutError("the recording daemon committed no batch")
        if daemon.stop() != 0:
            raise RuntimeError("the recording daemon did not stop cleanly:\n" + daemon.tail())

    def _record(self) -> None:
        from tests.integration.harness import write_config

        directory = self.root / "cds-recorder"
        directory.mkdir()
        extra = f"""
[spark]
master = "local[2]"
log_level = "ERROR"

[[cdc.streams]]
name = "delta"
collections = "*"
path = "{directory / "delta"}"

[[cdc.streams]]
name = "parquet"
collections = "*"
path = "{directory / "parquet"}"
format = "parquet"
"""
        config = write_config(directory, extra, cores=1, interval_ms=200)
        config.write_text(
            config.read_text().replace("class_sharing = false", "class_sharing = true")
        )
        folder = directory / "data" / "spark-cds"
        self._life(config)  # its JVM writes <key>.pending.jsa as it exits
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pending = list(folder.glob("spark-*.pending.jsa"))
            if pending and not _writing(pending[0]):
                break
            time.sleep(0.5)
        else:
            raise TimeoutError("no archive was written")
        self._life(config)  # the daemon checks the archive, which maps, and keeps it
        (jsa,) = [p for p in folder.glob("spark-*.jsa") if ".pending" not in p.name]
        tmp = self.root / (READY + ".tmp")
        tmp.write_text(str(jsa))
        tmp.replace(self.root / READY)
