"""What a command's terminal gets of the driver JVM's stderr (``quiet``):
its start-up notices are dropped, anything else is shown as written."""

from __future__ import annotations

import io

import pytest

from daemon.spark.session import _pump_jvm_stderr


def test_a_quiet_command_drops_the_jvm_start_up_lines_and_keeps_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    stderr = io.BytesIO(
        b"WARNING: Using incubator modules: jdk.incubator.vector\n"
        b'Setting default log level to "WARN".\n'
        b"To adjust logging level use sc.setLogLevel(newLevel). For SparkR, use setLogLevel.\n"
        b"\n"
        b"ERROR SparkContext: something the user must see\n"
    )
    _pump_jvm_stderr(stderr, quiet=True)
    assert capsys.readouterr().err == "ERROR SparkContext: something the user must see\n"
