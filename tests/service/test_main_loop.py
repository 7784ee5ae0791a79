"""The daemon's main loop ends on a component's fatal error and logs that
error (not ``None``), then exits non-zero (daemon/service/app.py)."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from daemon.config import load
from daemon.errors import DaemonError
from daemon.service.app import EXIT_FAILED, Daemon


class _FailedPlane:
    """The event plane's fail-stop contract alone: wait_failed() returns the error."""

    async def wait_failed(self) -> DaemonError:
        return DaemonError("WAL fsync failed: EIO on segment 00000001")


async def test_a_failed_component_is_logged_with_its_error_and_exits_non_zero(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[daemon]\ndata_dir = "{tmp_path / "data"}"\n')
    daemon = Daemon(load(config))
    daemon.plane = _FailedPlane()  # type: ignore[assignment]

    with capture_logs() as logs:
        await daemon.main_loop()

    assert daemon.exit_code == EXIT_FAILED and daemon.should_exit
    failed = [e for e in logs if e["event"] == "component.failed"]
    assert failed == [
        {
            "event": "component.failed",
            "log_level": "error",
            "error": "WAL fsync failed: EIO on segment 00000001",
            "kind": "DaemonError",
        }
    ]
