"""``eventplane cdc show``: latest committed rows, newest first; ``cdc files``: a snapshot."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest

from daemon.cli import cdc as cdccmd
from daemon.cli.main import build_parser
from tests.spark.support import make_batches, make_config

pytestmark = pytest.mark.spark


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["cdc", "show", *argv])


async def test_cdc_show_prints_the_latest_rows_newest_first(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory()
    for b in make_batches(3, 40):
        await ex.execute(b)
    out = io.StringIO()

    code = cdccmd.main(_args("all", "--limit", "5"), make_config(tmp_path), session=spark, out=out)

    assert code == 0
    lines = out.getvalue().splitlines()
    assert "last committed batch 3, latest 5 rows" in lines[0]
    # Every third test event has a producer (tests.spark.support.producer_of):
    # shown after key, as a producer's columns are when a row has one.
    columns = list(cdccmd.COLUMNS)
    assert lines[1].split() == [*columns[:6], "producer", *columns[6:]]
    assert [int(line.split()[0]) for line in lines[3:]] == [120, 119, 118, 117, 116]
    assert all(line.split()[1] == "3" for line in lines[3:])
    assert '"lsn":120' in lines[3]


async def test_cdc_show_lists_again_when_the_table_changed_while_it_read(
    spark: Any, executor_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change that removes files (a compaction's swap) between ``cdc show``'s
    listing and its read moves the table generation: the whole query runs
    again, and the rows shown are those of the table after the change."""
    from daemon.table.snapshot import read_generation, table_change

    ex = await executor_factory()
    for b in make_batches(2, 10):
        await ex.execute(b)
    stream = make_config(tmp_path).cdc.streams[0]
    listings: list[int] = []
    real = cdccmd.newest_files

    def listing_then_a_swap(s: Any, limit: int) -> list[Path]:
        files = real(s, limit)
        listings.append(read_generation(s.path))
        if len(listings) == 1:
            with table_change(s.path):  # what a compaction's swap does
                pass
        return files

    monkeypatch.setattr(cdccmd, "newest_files", listing_then_a_swap)

    rows = cdccmd.latest_rows(spark, stream, 3)

    assert len(listings) == 2 and listings[1] == listings[0] + 2
    assert [r["lsn"] for r in rows] == [20, 19, 18]


def test_cdc_show_unknown_stream_says_which_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cdccmd.main(_args("nope"), make_config(tmp_path)) == 1
    assert "no stream named 'nope' (streams: all)" in capsys.readouterr().err


def test_cdc_show_empty_stream_needs_no_spark(tmp_path: Path) -> None:
    out = io.StringIO()
    assert cdccmd.main(_args("all"), make_config(tmp_path), out=out) == 0
    assert "no committed rows yet" in out.getvalue()


async def test_cdc_files_lists_every_data_file_once_for_readers_of_any_kind(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """1. Three batches.  2. ``eventplane cdc files all`` prints one path per
    line, the same as ``--json``'s list.  3. Spark over those files sees every
    row once."""
    ex = await executor_factory()
    for b in make_batches(3, 40):
        await ex.execute(b)
    cfg = make_config(tmp_path)
    out, as_json = io.StringIO(), io.StringIO()
    parse = build_parser().parse_args

    assert cdccmd.main(parse(["cdc", "files", "all"]), cfg, out=out) == 0
    assert cdccmd.main(parse(["cdc", "files", "all", "--json"]), cfg, out=as_json) == 0

    files = out.getvalue().splitlines()
    doc = json.loads(as_json.getvalue())
    assert doc["files"] == files and doc["stream"] == "all" and doc["generation"] % 2 == 0
    assert len(files) == 6 and all("/collection=" in f and "/part-b" in f for f in files)
    root = str(tmp_path / "cdc" / "all")
    lsns = [r.lsn for r in spark.read.option("basePath", root).parquet(*files).collect()]
    assert sorted(lsns) == list(range(1, 121))


def test_cdc_files_of_a_stream_never_written_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["cdc", "files", "all"])
    assert cdccmd.main(args, make_config(tmp_path)) == 1
    assert "is not a folder" in capsys.readouterr().err
