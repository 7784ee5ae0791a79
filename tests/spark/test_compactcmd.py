"""``eventplane cdc compact``: through a running daemon's admin API, or on its own."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
from pathlib import Path
from typing import Any

import pytest

from daemon.cli import cdc as cdccmd
from daemon.cli.main import build_parser
from daemon.config import AdminConfig, Listen
from daemon.service.admin import AdminServer
from tests.conftest import free_port
from tests.spark.support import batch_lsns, make_batches, make_config
from tests.spark.test_compact import files_per_partition, visible_lsns

pytestmark = pytest.mark.spark

NO_COMPACTION = {"compaction": False}


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["cdc", "compact", *argv])


def _nobody() -> str:
    return f"http://127.0.0.1:{free_port()}"


async def test_without_a_daemon_it_locks_the_stream_and_compacts_itself(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(stream_options=NO_COMPACTION)
    batches = make_batches(5, 40)
    for b in batches:
        await ex.execute(b)
    await ex.stop()
    cfg = make_config(tmp_path, stream_options=NO_COMPACTION)
    table = tmp_path / "cdc" / "all"

    out = io.StringIO()
    code = cdccmd.main(_args("all", "--dry-run", "--url", _nobody()), cfg, session=spark, out=out)
    assert code == 0
    assert "collection=orders: 5 of 5 files" in out.getvalue(), out.getvalue()
    assert set(files_per_partition(table).values()) == {5}

    out = io.StringIO()
    code = cdccmd.main(_args("all", "--url", _nobody()), cfg, session=spark, out=out)
    assert code == 0, out.getvalue()
    text = out.getvalue()
    assert "compacting here" in text and "compaction #2 collection=users: done" in text
    assert "data files now: 2" in text
    assert files_per_partition(table) == {"collection=orders": 1, "collection=users": 1}
    assert visible_lsns(spark, table) == batch_lsns(batches)

    out = io.StringIO()
    assert cdccmd.main(_args("all", "--url", _nobody()), cfg, session=spark, out=out) == 0
    assert "nothing to compact" in out.getvalue()


async def test_with_a_daemon_it_asks_the_admin_api_and_prints_progress(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(stream_options=NO_COMPACTION)
    batches = make_batches(4, 40)
    for b in batches:
        await ex.execute(b)
    cfg = dataclasses.replace(
        make_config(tmp_path, stream_options=NO_COMPACTION),
        admin=AdminConfig(Listen("127.0.0.1", 0)),
    )
    admin = AdminServer(
        cfg, ex.metrics, status=ex.status, ready=lambda: True, compaction=ex.compaction
    )
    await admin.start()
    try:
        out = io.StringIO()
        code = await asyncio.to_thread(
            cdccmd.main, _args("all", "--dry-run", "--url", admin.url), cfg, out=out
        )
        assert code == 0 and "would compact" in out.getvalue()

        out = io.StringIO()
        code = await asyncio.to_thread(cdccmd.main, _args("all", "--url", admin.url), cfg, out=out)
        text = out.getvalue()
        assert code == 0, text
        assert "compaction requested from the daemon" in text
        assert "compaction #2 collection=users: done" in text and "data files now: 2" in text

        out = io.StringIO()
        code = await asyncio.to_thread(cdccmd.main, _args("nope", "--url", admin.url), cfg, out=out)
        assert code == 1
    finally:
        await admin.stop(1.0)
    table = tmp_path / "cdc" / "all"
    assert visible_lsns(spark, table) == batch_lsns(batches)
    status = ex.status()["streams"]["all"]["compaction"]
    assert status["compactions"] == 2 and status["files"] == 2


async def test_a_locked_stream_without_an_answering_daemon_is_refused(
    executor_factory: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ex = await executor_factory(stream_options=NO_COMPACTION)
    await ex.execute(make_batches(1, 10)[0])
    code = cdccmd.main(_args("all", "--url", _nobody()), make_config(tmp_path), out=io.StringIO())
    assert code == 1
    assert "no daemon answered" in capsys.readouterr().err
