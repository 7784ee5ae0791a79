"""The ingest benchmark still runs end to end (tiny durations; numbers not checked)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import bench_ingest


def test_bench_ingest_runs_and_reports_every_peer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    argv = ["--duration", "0.5", "--warmup", "0.2", "--clients", "2", "--batch", "100"]
    rc = bench_ingest.main([*argv, "--peers", "eventplane,fsync", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "eventplane ingest + WAL" in text and "aiohttp + fdatasync/request" in text
    assert "eventplane vs aiohttp + fdatasync/request" in text
    results = json.loads(out.read_text())
    assert [r["peer"] for r in results] == ["eventplane", "fsync"]
    assert all(r["events_per_s"] > 0 and r["p99_ms"] > 0 and not r["errors"] for r in results)


def test_bench_ingest_keys_compares_keyed_and_unkeyed_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--duration", "0.3", "--warmup", "0.1", "--clients", "2", "--batch", "100"]
    rc = bench_ingest.main([*argv, "--keys", "--repeat", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "eventplane, Idempotency-Key" in text
    assert "keyed / unkeyed:" in text


def test_bench_ingest_secure_compares_tls_and_token_with_plain(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--duration", "0.3", "--warmup", "0.1", "--clients", "2", "--batch", "100"]
    rc = bench_ingest.main([*argv, "--secure", "--repeat", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "eventplane, TLS + token" in text
    assert "secure / plain:" in text
    full, resumed = (
        float(x.replace(",", "")) for x in re.findall(r"([\d,]+)/s (?:full|resumed)", text)
    )
    assert full > 0 and resumed > 0
