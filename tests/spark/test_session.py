"""The embedded SparkSession's own settings."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import pytest

pytestmark = pytest.mark.spark


def test_embedded_spark_listens_on_loopback_only(spark: Any) -> None:
    """Under `make run` (a local master) no Spark port is reachable from the network."""
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed")
    pid = spark.sparkContext._gateway.proc.pid
    spark.range(10).count()  # make sure the block manager and the driver listen
    out = subprocess.run(
        ["ss", "-Hltnp"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    mine = [line for line in out.splitlines() if f"pid={pid}," in line]
    assert mine, f"no listening socket of the JVM {pid} found:\n{out}"
    addresses = [re.split(r"\s+", line)[3] for line in mine]
    assert all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in addresses), addresses
