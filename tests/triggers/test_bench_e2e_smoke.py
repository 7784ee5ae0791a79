"""The end-to-end trigger benchmark still runs (tiny durations; numbers not checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_triggers


@pytest.mark.spark
def test_bench_triggers_e2e_runs_both_sides_and_every_matched_row_arrives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """
    1. A daemon subprocess and a Structured Streaming subprocess each get a
       paced second of events and a short closed-loop burst.
    2. The table names both systems, every measured matched row arrived
       (exit code 0), and the daemon's time breakdown is printed.
    """
    out = tmp_path / "result.json"
    tiny = "--seconds 1 --warmup-seconds 1 --rate 1000 --request-events 100 --max-seconds 0.3"
    argv = ["--e2e", *tiny.split(), "--clients", "1", "--interval-ms", "250"]
    argv += ["--drain-timeout", "60"]
    argv += ["--dir", str(tmp_path / "work"), "--json", str(out)]
    rc = bench_triggers.main(argv)
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "eventplane (daemon)" in text and "peer (Structured Streaming)" in text
    assert "where the daemon's time went" in text
    lines = json.loads(out.read_text())["lines"]
    measured = {x["system"]: x["value"] for x in lines if x["metric"] == "matched rows measured"}
    assert measured == {"eventplane (daemon)": 100, "peer (Structured Streaming)": 100}
    processed = [x for x in lines if x["metric"].startswith("events/s processed")]
    assert len(processed) == 2 and all(x["value"] > 0 for x in processed)


@pytest.mark.spark
def test_bench_triggers_e2e_baseline_runs_both_daemons_and_compares_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """
    1. ``--baseline`` names a source tree (this one): its daemon and this tree's
       each get a paced second of events, with a CDC stream, in one round.
    2. Every measured matched row arrived on both sides (exit code 0), and the
       table has one row per side with its CPU-seconds, plus the p99 ratio.
    """
    out = tmp_path / "result.json"
    tree = Path(__file__).resolve().parents[2]
    tiny = "--seconds 1 --warmup-seconds 1 --rate 1000 --request-events 100"
    argv = ["--e2e", *tiny.split(), "--interval-ms", "250", "--cdc", "--drain-timeout", "60"]
    argv += ["--baseline", str(tree), "--rounds", "1"]
    argv += ["--dir", str(tmp_path / "work"), "--json", str(out)]
    rc = bench_triggers.main(argv)
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "| 1 | eventplane |" in text and "| 1 | baseline |" in text
    assert "p99 baseline / eventplane per round" in text
    rounds = json.loads(out.read_text())["rounds"]
    assert sorted(r["side"] for r in rounds) == ["baseline", "eventplane"]
    assert all(r["missing"] == 0 and r["cpu_s"] > 0 for r in rounds)
