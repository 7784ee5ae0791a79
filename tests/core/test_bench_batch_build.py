"""The batch-build benchmark runs end to end and its sides write the same file
(a tiny run; the figures are not checked here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_batch_build

ROOT = Path(__file__).resolve().parents[2]


def test_bench_batch_build_prints_a_row_per_part_size_with_a_baseline_side(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """This tree is its own baseline here."""
    argv = ["--events", "3000", "--part-rows", "50,2000", "--rounds", "1", "--baseline", str(ROOT)]

    assert bench_batch_build.main(argv) == 0

    out = capsys.readouterr().out
    assert "| 50 |" in out and "| 2,000 |" in out
    assert "differs" not in out
