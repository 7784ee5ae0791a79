"""Installed as users install: the wheel, in a venv of its own, runs a daemon.

1. Build the wheel from a copy of this tree (``pip wheel --no-build-isolation``
   in the project's venv, as docs/operating.md does), with javac at hand.
2. It carries the daemon's jar and its Java sources.
3. A fresh venv gets the locked runtime dependencies and the wheel, nothing of
   this checkout (no PYTHONPATH, another working directory).
4. ``eventplane setup`` there finds every part; the daemon it starts writes
   batches without a Spark job (the jar is loaded) and reports no missing part.
5. The events posted are in the table, once each.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from tests.integration.harness import ROOT, DaemonProcess, make_events, post_events, write_config

pytestmark = [pytest.mark.spark, pytest.mark.crash]

UV = Path(sys.executable).with_name("uv")


def _copy_tree(dest: Path) -> None:
    """The files git tracks or would (not ignored): what a checkout has."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        src = ROOT / os.fsdecode(name)
        if src.is_file():
            (dest / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(name))


def _lsns(table: Path) -> list[int]:
    """The table's committed LSNs, whichever format the default stream has."""
    if (table / "_delta_log").is_dir():
        from deltalake import DeltaTable

        return list(DeltaTable(str(table)).to_pyarrow_table(columns=["lsn"])["lsn"].to_pylist())
    if not table.is_dir():
        return []
    data = ds.dataset(table, format="parquet", partitioning="hive", exclude_invalid_files=True)
    if "lsn" not in data.schema.names:  # no committed file yet
        return []
    return list(data.to_table(columns=["lsn"])["lsn"].to_pylist())


@pytest.mark.timeout(600)
def test_the_wheel_installed_in_a_fresh_venv_carries_its_jar_and_runs_a_daemon(
    tmp_path: Path,
) -> None:
    if shutil.which("javac") is None:
        pytest.fail("javac is missing: the wheel's jar needs it (apt-get install openjdk-17-jdk)")
    # Steps 1 and 2.
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    _copy_tree(src)
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip, "-w", str(wheels), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("eventplane-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "daemon/spark/jars/eventplane-hadoop.jar" in names
    assert "daemon/spark/jvm/eventplane/inbox/DirectWrite.java" in names
    # Step 3. The venv's python is this interpreter's base, not this venv.
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [str(UV), "pip", "install", "--quiet", "--python", str(python)]
    locked = [*install, "--require-hashes", "--no-deps", "--no-build-isolation"]
    for lock in ("requirements-setup.lock", "requirements-runtime.lock"):
        subprocess.run([*locked, "-r", str(ROOT / lock)], check=True)
    subprocess.run([*install, "--no-deps", str(wheel)], check=True)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run(
        [str(python), "-c", "import daemon; print(daemon.__file__)"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(venv)), where
    # Step 4.
    table = tmp_path / "table"
    cfg = write_config(
        tmp_path,
        f'\n[[cdc.streams]]\nname = "all"\ncollections = "*"\npath = "{table}"\n',
        cores=2,
    )
    setup = subprocess.run(
        [str(venv / "bin" / "eventplane"), "setup", "--config", str(cfg)],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        check=False,
    )
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert "daemon jar: " in setup.stdout and "up to date" in setup.stdout
    argv = [str(venv / "bin" / "eventplane"), "run", "--config", str(cfg)]
    daemon = DaemonProcess(cfg, argv, tmp_path / "daemon.log", env={"PYTHONPATH": ""})
    daemon.start(timeout_s=180)
    try:
        acked = [post_events(daemon.ingest_url, make_events(i * 100, 100)) for i in range(5)]
        last = acked[-1]["last_lsn"]
        # The JVM's start is most of the wait (minutes on a loaded 2-core machine).
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and len(_lsns(table)) < last:
            time.sleep(0.2)
        assert sorted(_lsns(table)) == list(range(1, last + 1))
        spark = daemon.status()["spark"]
        assert spark["missing_parts"] == []
        assert spark["cdc_write"] == "direct", spark
        assert daemon.stop() == 0, daemon.tail()
    finally:
        daemon.stop()
