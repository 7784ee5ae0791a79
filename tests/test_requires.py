"""A test whose tool is missing skips outside CI and fails under it, naming
the tool (tests/requires.py): here the TLS suite's ``openssl``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
from tests.ingest.certs import make_pki

def test_probe(tmp_path):
    make_pki(tmp_path / "pki")
"""


@pytest.mark.parametrize(("ci", "outcome"), [("true", "1 failed"), ("", "1 skipped")])
def test_a_missing_openssl_fails_the_run_under_ci_and_skips_elsewhere(
    tmp_path: Path, ci: str, outcome: str
) -> None:
    """1. A test that makes certificates, run with a PATH that has no openssl.
    2. With ``CI`` set it fails and names openssl; without, it skips and says so."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty), "CI": ci, "PYTHONPATH": str(ROOT)}
    args = ["-q", "-rs", "-p", "no:cacheprovider", f"--rootdir={tmp_path}", "-c", os.devnull]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, f"--basetemp={tmp_path / 'pt'}", str(probe)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert outcome in proc.stdout, proc.stdout + proc.stderr
    assert "the openssl command" in proc.stdout, proc.stdout
