"""Fault injection for real daemons: size-limited volumes, health polling."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import ROOT, DaemonProcess, write_config


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "32m") -> Iterator[Path]:
    """A size-limited tmpfs at ``path`` (root only: skips the test otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(volume: Path) -> Path:
    """Write a file that takes every free byte of ``volume``; returns it."""
    filler = volume / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for size in (1 << 20, 4096, 1):  # big writes, then the last bytes
            chunk = b"\0" * size
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, chunk)
    finally:
        os.close(fd)
    return filler


def healthz(daemon: DaemonProcess) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(daemon.admin_url + "/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        exc.close()
        return exc.code, json.loads(body)


def metric(daemon: DaemonProcess, sample: str) -> float | None:
    """The value of one exposition line starting with ``sample`` (name and labels)."""
    with urllib.request.urlopen(daemon.admin_url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.rsplit(" ", 1)[1])
    return None


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, daemon: DaemonProcess) -> Any:
    """Poll ``check`` until it returns something truthy; fail with the daemon's log."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})\n{daemon.tail(60)}")


def stage(status: dict[str, Any], name: str) -> dict[str, Any]:
    for st in status.get("stages", []):
        if st["name"] == name:
            return dict(st)
    raise KeyError(f"no stage {name!r} in {status.get('stages')}")


def spark_config(
    tmp_path: Path,
    streams: dict[str, Path] | None = None,
    extra: str = "",
    stall_after_s: float | None = None,
) -> Path:
    """A daemon config on free ports with embedded Spark (``local[2]``, 2 cores,
    200 ms batches), the CDC ``streams`` (name -> path; default one stream
    ``all`` under ``tmp_path/cdc/all``), ``[health] stall_after_s`` if given,
    and ``extra`` TOML (triggers) appended."""
    streams = streams if streams is not None else {"all": tmp_path / "cdc" / "all"}
    text = """
[spark]
master = "local[2]"
log_level = "ERROR"

[spark.conf]
"spark.sql.shuffle.partitions" = "2"
"""
    if stall_after_s is not None:
        text += f"\n[health]\nstall_after_s = {stall_after_s}\n"
    for name, path in streams.items():
        text += f'\n[[cdc.streams]]\nname = "{name}"\ncollections = "*"\npath = "{path}"\n'
        text += 'format = "parquet"\n'
    return write_config(tmp_path, cores=2, interval_ms=200, extra=text + extra)


def cli(daemon: DaemonProcess, *argv: str) -> subprocess.CompletedProcess[str]:
    """``eventplane ARGV --url <the daemon's admin URL>`` in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli.main", *argv, "--url", daemon.admin_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
