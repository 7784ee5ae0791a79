"""A real daemon whose executor appends every delivered record to a file.

Run as ``python -m tests.integration.recording_daemon CONFIG RECORD_FILE``.
Everything but the executor is the production daemon; the executor fsyncs
``lsn core batch_id`` lines before returning, so after a SIGKILL the file
holds at least everything the daemon counted as committed. Each execute
writes a ``B <batch_id> <rows>`` header, so re-runs can be compared.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from daemon import config
from daemon.plane.batch import Executor, MicroBatch
from daemon.service import app


class FileRecordingExecutor:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    async def start(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def ready(self) -> bool:
        return self._fd >= 0

    async def execute(self, batch: MicroBatch) -> None:
        lines = [f"B {batch.batch_id} {batch.rows}\n"]
        lines += [
            f"{r.lsn} {core} {batch.batch_id}\n"
            for core, sl in sorted(batch.slices.items())
            for r in sl.records
        ]
        # One write per batch: a SIGKILL cannot split a write(2) to a regular file.
        os.write(self._fd, "".join(lines).encode())
        os.fsync(self._fd)

    async def stop(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class RecordingDaemon(app.Daemon):
    record_path: Path

    def _build_executor(self) -> Executor:
        return FileRecordingExecutor(self.record_path)


def main() -> int:
    cfg = config.load(sys.argv[1])
    RecordingDaemon.record_path = Path(sys.argv[2])
    return app.run(cfg, daemon_factory=RecordingDaemon)


if __name__ == "__main__":
    sys.exit(main())
