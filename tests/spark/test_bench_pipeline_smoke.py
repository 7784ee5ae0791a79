"""The whole-pipeline benchmark still runs (tiny sizes; numbers not checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_pipeline
from tests import requires

TINY = [
    "--events", "3000", "--warmup-events", "1000", "--clients", "2", "--rate", "1000",
    "--latency-seconds", "1", "--latency-warmup-seconds", "0.4", "--interval-ms", "250",
    "--warmup-drains", "1",
]  # fmt: skip


def test_tree_cpu_counts_children_that_have_exited() -> None:
    """A child's CPU stays in the figure after it exits (its parent reaped it)."""
    before = bench_pipeline.tree_cpu(os.getpid())
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert bench_pipeline.tree_cpu(os.getpid()) - before >= 0.25


def test_missing_postgresql_prints_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = f"missing pg_ctl; install with: {bench_pipeline.PG_INSTALL}"
    monkeypatch.setattr(bench_pipeline, "find_pg", lambda: missing)
    argv = [*TINY, "--no-eventplane", "--peers", "outbox", "--dir", str(tmp_path)]
    rc = bench_pipeline.main(argv)
    captured = capsys.readouterr()
    assert rc == 0
    assert "apt-get install -y --no-install-recommends postgresql libpostgresql-jdbc-java" in (
        captured.out
    )
    assert "outbox peer skipped" in captured.err


@pytest.mark.spark
def test_bench_pipeline_runs_eventplane_and_the_landing_peer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """
    1. The daemon and the landing peer (HTTP server + Structured Streaming
       process) each take the warm-up, the closed-loop run and a paced second.
    2. Every event sent is in each table once (exit code 0), the table names
       every side and the reference row, latencies and the paced run's CPU
       were measured, and the daemon's batches were counted.

    ``--baseline`` (the daemon again, from another source tree): the soak
    test below.
    """
    out = tmp_path / "result.json"
    argv = [*TINY, "--peers", "landing", "--dir", str(tmp_path / "work"), "--json", str(out)]
    rc = bench_pipeline.main(argv)
    text = capsys.readouterr().out
    assert rc == 0, text
    for label in ("eventplane", "landing", "reference"):
        assert bench_pipeline.LABELS[label] in text
    sides = {s["name"]: s for s in json.loads(out.read_text())["sides"]}
    assert set(sides) == {"eventplane", "landing"}
    run, paced = sides["eventplane"]["batches"]
    assert run >= 1 and paced >= 1
    for s in sides.values():
        assert s["events_per_s"] > 0 and s["latency_requests"] > 0 and not s["error"]
        assert s["rows_checked"] == 1000 + 3000 + 1400
        assert s["cpu_s"]["spark"] > 0 and "producers" in s["cpu_s"]
        assert 0 < s["latency_cores"] <= (os.cpu_count() or 64)


@pytest.mark.spark
def test_bench_pipeline_runs_the_postgresql_outbox_peer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its own PostgreSQL cluster, the COPY server and the JDBC job; skipped
    (with the install command) where Debian's packages are missing."""
    tools = bench_pipeline.find_pg()
    if isinstance(tools, str):
        requires.missing("PostgreSQL", tools)
    out = tmp_path / "result.json"
    argv = [*TINY, "--no-eventplane", "--peers", "outbox", "--json", str(out)]
    rc = bench_pipeline.main([*argv, "--dir", str(tmp_path / "work")])
    text = capsys.readouterr().out
    assert rc == 0, text
    (side,) = json.loads(out.read_text())["sides"]
    assert side["name"] == "outbox" and not side["error"] and not side["skipped"]
    assert side["rows_checked"] == 1000 + 3000 + 1400
    assert side["cpu_s"]["database"] > 0 and side["latency_requests"] > 0


@pytest.mark.spark
@pytest.mark.soak
def test_bench_pipeline_with_delta_tables_counts_every_event_once_on_every_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--format delta``: the daemon, the daemon again from ``--baseline``'s
    source tree (this one, here), the landing peer (Structured Streaming's
    Delta sink) and the outbox peer (Delta appends with ``txnVersion``) each
    end with every event in their Delta table once, counted through the log."""
    requires.delta_jars()
    out = tmp_path / "result.json"
    repo = Path(__file__).resolve().parents[2]
    peers = "landing,outbox" if not isinstance(bench_pipeline.find_pg(), str) else "landing"
    argv = [*TINY, "--format", "delta", "--peers", peers, "--baseline", str(repo)]
    rc = bench_pipeline.main([*argv, "--json", str(out), "--dir", str(tmp_path / "work")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert bench_pipeline.LABELS["baseline"] in text
    result = json.loads(out.read_text())
    assert result["format"] == "delta"
    assert {"eventplane", "baseline", "landing"} <= {s["name"] for s in result["sides"]}
    for side in result["sides"]:
        if side["name"] in ("eventplane", "baseline"):
            run, paced = side["batches"]
            assert run >= 1 and paced >= 1
    for side in result["sides"]:
        assert not side["error"], side
        assert side["rows_checked"] == 1000 + 3000 + 1400


def test_best_of_rounds_takes_the_fastest_round_and_the_lowest_p99() -> None:
    slow = bench_pipeline.SideResult("landing", events=10, visible_s=2.0, cpu={"spark": 1.0})
    slow.latencies = [0.1, 0.2]
    fast = bench_pipeline.SideResult("landing", events=10, visible_s=1.0, cpu={"spark": 3.0})
    fast.latencies = [0.5, 0.9]
    failed = bench_pipeline.SideResult("outbox", error="boom")
    (landing, outbox) = bench_pipeline.best_of([slow, fast, failed])
    assert landing.visible_s == 1.0 and landing.cpu == {"spark": 3.0}
    assert landing.latencies == [0.1, 0.2]
    assert outbox.error == "boom"
    text = bench_pipeline.render_rounds([(1, slow), (2, fast), (1, failed)])
    assert "| 2 | landing | 0.00 | 1.00 | 300000.0 (0.0 / 300000.0) | - |" in text
    assert "| 1 | outbox | boom |" in text
